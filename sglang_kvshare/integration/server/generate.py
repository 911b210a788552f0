"""The one hook on ``TokenizerManager.generate_request`` (AROUND), through which every request of
the HTTP process runs (``/generate``, the OpenAI endpoints, the plugin's own prefills):

- every output's ``meta_info.kvshare`` is one object, the request's latest record (the scheduler
  emits it once per request; streamed chunks after that carry it too);
- a finished annotated request's record is counted in the ``kvshare_*`` metrics when SGLang's
  metrics are on, streamed or not;
- an annotated chat request (a ``ChatShare`` in its ASGI scope, ``chat.py``) first gets the
  prefills its method needs (``prefills.py``); its record is kept for the answer, and when it is
  done the agent's output tokens are remembered (ReBaseShared LP: its rebuild is queued).
"""

from __future__ import annotations

from sglang_kvshare.integration.hookspec import HookSet
from sglang_kvshare.integration.server.annotate import with_spec
from sglang_kvshare.integration.server.chat_serving import share_of
from sglang_kvshare.methods import get_method
from sglang_kvshare.segments.wire import KEY, one_record

HOOKS = HookSet()


@HOOKS.around("sglang.srt.managers.tokenizer_manager.TokenizerManager.generate_request", ("self", "obj", "request"))
async def generate_request(ctx, original, manager, obj, request=None):
    share = share_of(request)
    if share is not None and share.wire is not None:
        obj.sampling_params = with_spec(obj.sampling_params, await share.owner.prepare(
            share.ann, share.wire, share.input_ids))
    else:
        share = None
    count = bool(getattr(manager, "enable_metrics", False))
    incremental = bool(obj.stream) and manager.incremental_streaming_output
    records: dict[int, dict] = {}  # output index -> the latest record
    first = {"text": "", "output_ids": []}  # the first choice's answer so far (annotated chat)
    async for out in original(manager, obj, request):
        for item in out if isinstance(out, list) else [out]:
            meta = item.get("meta_info")
            index = item.get("index", 0)
            record = None if meta is None else one_record(meta.get(KEY)) or records.get(index)
            if record is None:
                continue
            records[index] = meta[KEY] = record
            if count and meta.get("finish_reason") is not None:
                ctx.metrics.record(record)
            if share is not None:
                share.record = record
                if index == 0:
                    first = {**item, "text": first["text"] + item.get("text", ""),
                             "output_ids": first["output_ids"] + list(item.get("output_ids") or [])} \
                        if incremental else item
        yield out
    if share is not None:
        share.owner.remember(share.ann, first)
        if get_method(share.ann.method).lr_sharing == "rebase_lp" and obj.lora_path is not None:
            share.owner.queue_rebuild(share.ann, share.input_ids, first)
