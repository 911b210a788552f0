"""Tokenizer-side hook (AFTER ``TokenizerManager.update_request_meta_info``): ``meta_info.kvshare``
is one object, not a per-chunk list; a finished request's record is counted in the ``kvshare_*``
metrics when SGLang's metrics are on."""

from __future__ import annotations

from sglang_kvshare.integration.hookspec import HookSet
from sglang_kvshare.segments.wire import KEY, one_record

HOOKS = HookSet()


@HOOKS.after("sglang.srt.managers.tokenizer_manager.TokenizerManager.update_request_meta_info",
             ("self", "meta_info", "state", "customized_info", "index", "finish_reason"))
def update_request_meta_info(metrics, result, manager, meta_info, state, customized_info, index, finish_reason,
                             *args, **kwargs):
    if KEY in meta_info:
        meta_info[KEY] = one_record(meta_info[KEY])
    if finish_reason is not None and getattr(manager, "enable_metrics", False):
        metrics.record(meta_info.get(KEY))
    return result
