"""The one hook on ``TokenizerManager.generate_request`` (AROUND), through which every request of
the HTTP process runs (``/generate``, the OpenAI endpoints, the plugin's own prefills):

- every output's ``meta_info.kvshare`` is one object, the request's latest record (the scheduler
  emits it once per request; streamed chunks after that carry it too);
- a finished annotated request's record is counted in the ``kvshare_*`` metrics when SGLang's
  metrics are on, streamed or not;
- an annotated request the middleware handed on (a ``share.RequestShare`` in its ASGI scope:
  ``/generate``, or a chat request once SGLang converted it) first gets the prefills its method
  needs; its record is kept for the answer; when its first choice is complete, the agent's
  output tokens are remembered (ReBaseShared LP: its rebuild is queued). That happens at the
  final output, before it is yielded: SGLang takes only the first output of a request that does
  not stream.
"""

from __future__ import annotations

from sglang_kvshare.integration.hookspec import HookSet
from sglang_kvshare.integration.server.annotate import with_spec
from sglang_kvshare.integration.server.share import share_of
from sglang_kvshare.segments.wire import KEY, one_record

HOOKS = HookSet()


@HOOKS.around("sglang.srt.managers.tokenizer_manager.TokenizerManager.generate_request", ("self", "obj", "request"))
async def generate_request(ctx, original, manager, obj, request=None):
    share = share_of(request)
    if share is not None and share.wire is not None:
        obj.sampling_params = with_spec(obj.sampling_params, await share.prepare())
    else:
        share = None
    count = bool(getattr(manager, "enable_metrics", False))
    incremental = bool(obj.stream) and manager.incremental_streaming_output
    records: dict[int, dict] = {}  # output index -> the latest record
    text: list[str] = []  # the first choice's answer so far (incremental streaming)
    ids: list[int] = []
    async for out in original(manager, obj, request):
        for item in out if isinstance(out, list) else [out]:
            meta = item.get("meta_info")
            index = item.get("index", 0)
            record = None if meta is None else one_record(meta.get(KEY))
            if record is not None and share is not None:
                record = share.with_notes(record)
            record = record or records.get(index)
            if record is None:
                continue
            records[index] = meta[KEY] = record
            finished = meta.get("finish_reason") is not None
            if count and finished:
                ctx.metrics.record(record)
            if share is None:
                continue
            share.record = record
            if index == 0:
                answer = item
                if incremental:
                    text.append(item.get("text", ""))
                    ids.extend(item.get("output_ids") or ())
                    answer = {**item, "text": "".join(text), "output_ids": ids}
                if finished:
                    share.finish(answer, obj.lora_path)
        yield out
