"""Every hook the plugin registers on SGLang, by the context it is registered with, and the
startup check of their targets (``hookspec.check``). Adding a hook: declare it in its module's
``HookSet``; a new module's set is listed here."""

from __future__ import annotations

from sglang_kvshare.integration import hookspec
from sglang_kvshare.integration.cache import views
from sglang_kvshare.integration.model import lora_hooks, recompute_layer
from sglang_kvshare.integration.scheduler import double_batch, prefill, requests, worker_forward
from sglang_kvshare.integration.server import chat_serving, generate

# hooks of the HTTP (tokenizer) process: registered with its ``server.context.ServerContext``
SERVER_HOOKS = (generate.HOOKS, chat_serving.HOOKS)
# hooks of the scheduler process (its scheduling loop and model forward): registered with the session
SCHEDULER_HOOKS = (
    prefill.HOOKS,
    requests.HOOKS,
    double_batch.HOOKS,
    worker_forward.HOOKS,
    lora_hooks.HOOKS,
    recompute_layer.HOOKS,
    views.HOOKS,
)


def all_hooks() -> list[hookspec.Hook]:
    return [hook for hook_set in SERVER_HOOKS + SCHEDULER_HOOKS for hook in hook_set.hooks]


def check_hook_targets() -> None:
    """Raise ``RuntimeError`` naming the first hooked SGLang target that changed."""
    hookspec.check(all_hooks())
