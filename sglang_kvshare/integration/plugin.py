"""The ``sglang.srt.plugins`` entry point and the plugin's composition root (nothing imports it).

SGLang calls :func:`load` in its main, scheduler and detokenizer processes. It builds the
process's :class:`~sglang_kvshare.integration.state.session.Session` (from the ``--kvshare-*``
configuration the launcher put in the environment) and hands it to everything that needs it: the
scheduler-side and model-side hooks (``hooks.SCHEDULER_HOOKS``), the ``kvshare`` radix-cache
backend (with the scheduler's release step) and the ``kvshare_torch`` attention backend, which
SGLang constructs in the scheduler process. The HTTP process's hooks get its
``server.context.ServerContext`` (the ``kvshare_*`` metrics, the chat requests being converted). Whether it is loaded is the only module-level state.
"""

from __future__ import annotations

import functools
import logging

import torch
from sglang.srt.mem_cache.registry import register_radix_cache_backend

from sglang_kvshare import check_sglang_version
from sglang_kvshare.config import KVShareArgs
from sglang_kvshare.integration import hooks
from sglang_kvshare.integration.cache import radix
from sglang_kvshare.integration.cpu_shims import unpin_lora
from sglang_kvshare.integration.model import attention
from sglang_kvshare.integration.scheduler.release import release
from sglang_kvshare.integration.server.context import ServerContext
from sglang_kvshare.integration.state.session import Session

logger = logging.getLogger(__name__)

_LOADED = False


def _build_tree(session: Session, ctx):
    """SGLang's radix-cache factory for ``kvshare``: the tree, then the warm start (the launcher
    checked the anchor pool file already). Runs in the scheduler process."""
    tree = radix.build(ctx, session, functools.partial(release, session))
    session.anchor_file.load()
    session.anchor_file.install_signal_handlers()
    return tree


def load() -> None:
    global _LOADED
    if _LOADED:
        return
    check_sglang_version()
    if not torch.cuda.is_available():
        unpin_lora()
    session = Session(KVShareArgs.from_env())
    register_radix_cache_backend(radix.BACKEND_NAME, functools.partial(_build_tree, session))
    attention.register(session)
    for hook_set in hooks.SCHEDULER_HOOKS:
        hook_set.register(session)
    server = ServerContext()
    for hook_set in hooks.SERVER_HOOKS:
        hook_set.register(server)
    _LOADED = True
    logger.info("sglang_kvshare plugin loaded")
