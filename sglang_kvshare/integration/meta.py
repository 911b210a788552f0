"""Tokenizer-side hook: ``meta_info.kvshare`` is one object, not a per-chunk list; a finished
request's record is counted in the ``kvshare_*`` metrics when SGLang's metrics are on."""

from __future__ import annotations

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from sglang_kvshare.integration.state import META_KEY

TARGET = "sglang.srt.managers.tokenizer_manager.TokenizerManager.update_request_meta_info"


def _update_request_meta_info(result, manager, meta_info, state, customized_info, index, finish_reason,
                              *args, **kwargs):
    records = meta_info.get(META_KEY)
    if isinstance(records, list):
        meta_info[META_KEY] = records[-1] if records else None
    if finish_reason is not None and getattr(manager, "enable_metrics", False):
        from sglang_kvshare.integration import metrics

        metrics.record(meta_info.get(META_KEY))
    return result


def register_tokenizer_hooks() -> None:
    HookRegistry.register(TARGET, _update_request_meta_info, HookType.AFTER)
