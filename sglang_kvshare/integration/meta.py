"""Tokenizer-side hook: ``meta_info.kvshare`` is one object, not a per-chunk list."""

from __future__ import annotations

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from sglang_kvshare.integration.state import META_KEY

TARGET = "sglang.srt.managers.tokenizer_manager.TokenizerManager.update_request_meta_info"


def _update_request_meta_info(result, manager, meta_info, *args, **kwargs):
    records = meta_info.get(META_KEY)
    if isinstance(records, list):
        meta_info[META_KEY] = records[-1] if records else None
    return result


def register_tokenizer_hooks() -> None:
    HookRegistry.register(TARGET, _update_request_meta_info, HookType.AFTER)
