"""The ``sglang.srt.plugins`` entry point: registers everything the plugin adds to SGLang.

SGLang calls :func:`load` in its main, scheduler and detokenizer processes. It registers the
``kvshare`` radix-cache backend, the ``kvshare_torch`` attention backend and the HookRegistry
hooks (scheduler side: segment-wise prefill, the LR cache's LoRA hooks, ReBaseShared's double
batching, its own-LR-column copies and the decoder-layer hook of selective recomputation; tokenizer side: the
``meta_info.kvshare`` record).

The registration is the plugin's only module-level state: whether it is loaded, the process's
:class:`~sglang_kvshare.integration.session.Session` (scheduler process; created on first use,
from the ``--kvshare-*`` configuration the launcher put in the environment) and the ``kvshare_*``
metrics (HTTP process).
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

_REGISTRATION: dict = {"loaded": False, "session": None, "metrics": None}


def session():
    """The plugin's session in this process."""
    if _REGISTRATION["session"] is None:
        from sglang_kvshare.config import KVShareArgs
        from sglang_kvshare.integration.session import Session

        _REGISTRATION["session"] = Session(KVShareArgs.from_env())
    return _REGISTRATION["session"]


def metrics() -> dict:
    """The ``kvshare_*`` Prometheus metrics of this (HTTP) process, created on first use."""
    if _REGISTRATION["metrics"] is None:
        from sglang_kvshare.integration.metrics import create_metrics

        _REGISTRATION["metrics"] = create_metrics()
    return _REGISTRATION["metrics"]


def load() -> None:
    if _REGISTRATION["loaded"]:
        return
    from sglang_kvshare import check_sglang_version

    check_sglang_version()
    from sglang_kvshare.integration.attention import register_attention
    from sglang_kvshare.integration.double_batch import register_double_batch_hooks
    from sglang_kvshare.integration.lr_cache import register_lr_hooks
    from sglang_kvshare.integration.meta import register_tokenizer_hooks
    from sglang_kvshare.integration.own_lr import register_own_lr_hooks
    from sglang_kvshare.integration.recompute_forward import register_recompute_hooks
    from sglang_kvshare.integration.scheduler_hooks import register_scheduler_hooks
    from sglang_kvshare.integration.tree import register_tree

    import torch

    if not torch.cuda.is_available():
        from sglang_kvshare.integration.cpu_shims import unpin_lora

        unpin_lora()
    register_tree()
    register_attention()
    register_scheduler_hooks()
    register_lr_hooks()
    register_double_batch_hooks()
    register_own_lr_hooks()
    register_recompute_hooks()
    register_tokenizer_hooks()
    _REGISTRATION["loaded"] = True
    logger.info("sglang_kvshare plugin loaded")
