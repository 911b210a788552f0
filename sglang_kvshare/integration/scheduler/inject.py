"""Writing a source agent's cached K/V of a shared segment into a request's KV slots.

Called from the scheduler between two prefill chunks of the request (see ``prefill.py``), so
the injected slots count as prefix for the next chunk. With KV views (``cache/views.py``) the
request reads the source's slots in place; else keys are copied and moved to the new positions
with an exact RoPE rotation (``sglang_kvshare.rope``), values copied.
"""

from __future__ import annotations

import time
from typing import Optional

import torch

from sglang_kvshare.integration.cache.kv_io import (
    InjectResult,
    alloc_slots,
    gather_aligned,
    kv_layers,
    read_source,
    write_layers,
)
from sglang_kvshare.integration.cache.views import viewable
from sglang_kvshare.kernels.kv_correct import kv_correct
from sglang_kvshare.rope import RopeSpec
from sglang_kvshare.segments import Span
from sglang_kvshare.segments.sources import SourceRecord, common_prefix


def injectable_len(req, span: Span, rec: SourceRecord) -> int:
    """Leading tokens of ``span`` that ``rec`` can stand for: equal tokens, and at least one
    prompt token left to compute after them (its logits are needed)."""
    fill = req.full_untruncated_fill_ids
    limit = min(len(span), len(fill) - 1 - span.start)
    if limit <= 0:
        return 0
    return common_prefix(rec.token_ids[rec.start : rec.end], fill[span.start : span.start + limit])


def inject_segment(
    ses, scheduler, req, span: Span, rec: SourceRecord, num_tokens: int, rope: RopeSpec
) -> Optional[InjectResult]:
    """Up to ``num_tokens`` of ``rec``'s cached K/V for ``span``: a view of the source's slots
    (``views.viewable``), or a copy (keys re-aligned) in new
    slots; None (nothing changed) when the source is gone or no KV slots can be had."""
    t0 = time.perf_counter()
    st = ses.lookup(req)
    try:
        return _inject(ses, scheduler, req, st, span, rec, num_tokens, rope)
    finally:
        st.inject_ms += (time.perf_counter() - t0) * 1e3


def _inject(ses, scheduler, req, st, span, rec, num_tokens, rope) -> Optional[InjectResult]:
    with read_source(scheduler.tree_cache, rec, num_tokens) as src:
        if src is None:
            return None
        if viewable(ses.views, st.spec, len(src)) and ses.views.readable(rec.agent, st.spec, src):
            ses.views.read_in_place(st, src, torch.arange(rec.start, rec.start + len(src)), rec.agent)
            return InjectResult(num_tokens=len(src), source_agent=rec.agent, dst=src)
        dst = alloc_slots(scheduler, req, span.start, len(src))
        if dst is None:
            return None
        pool = scheduler.token_to_kv_pool_allocator.get_kvcache()
        dst64, delta = dst.to(torch.int64), span.start - rec.start
        if src.is_cuda:
            for k_buf, v_buf in kv_layers(pool):
                kv_correct(k_buf, v_buf, src, dst64, delta, rope)
        else:
            write_layers(pool, dst64, *gather_aligned(pool, src, rec.start, delta, rope, ses.views, rec.agent))
        if ses.lr is not None:
            ses.lr.copy_rows(src, dst64)
    return InjectResult(num_tokens=len(src), source_agent=rec.agent, dst=dst)
