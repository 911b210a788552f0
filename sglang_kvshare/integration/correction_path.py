"""Correction methods (KVCMAS, KVComm, GraphFlow, ...) applied inside the engine.

Between two prefill chunks, for a shared segment with a source cache:
1. gather the source's (and, for non-chained methods, the context-free reference's) K/V from the
   tree into canonical coordinates (keys rotated back so the segment starts at position 0);
2. ``Corrector.correct``: accepted -> the corrected cache is rotated to the request's positions
   and written into new slots, which become prefix of the next chunk (mode ``corrected``);
   rejected -> the segment is prefilled densely (mode ``dense_fallback``) and, when the request
   is released, its exact K/V are handed to ``Corrector.observe`` (a new anchor).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from sglang_kvshare.correction import SegmentKV
from sglang_kvshare.integration.injection import InjectResult, alloc_slots, kv_layers
from sglang_kvshare.rope import RopeSpec, shift_keys
from sglang_kvshare.segments import Span
from sglang_kvshare.segments.sources import SourceRecord


@dataclass
class PendingObservation:
    """What ``observe`` needs after a dense fallback, kept until the exact KV exists."""

    source_agent: str
    source: SegmentKV
    reference: Optional[SegmentKV]
    num_tokens: int


@torch.no_grad()
def gather_canonical(pool, idx: torch.Tensor, start: int, rope: RopeSpec) -> SegmentKV:
    """K/V of slots ``idx`` (a segment that starts at ``start``) as [L, n, H*D], keys at 0."""
    idx = idx.to(torch.int64)
    layers = list(kv_layers(pool))
    k = torch.stack([k_buf[idx] for k_buf, _ in layers], dim=1)  # [n, L, H, D]
    n, L, H, D = k.shape
    k = shift_keys(k.reshape(n, L * H, D), -start, rope).reshape(n, L, H * D).transpose(0, 1)
    v = torch.stack([v_buf[idx].reshape(n, H * D) for _, v_buf in layers])
    return SegmentKV(k.contiguous(), v)


@torch.no_grad()
def write_canonical(pool, dst: torch.Tensor, kv: SegmentKV, start: int, rope: RopeSpec) -> None:
    """Write canonical ``kv`` (first ``len(dst)`` rows) into slots ``dst`` at position ``start``."""
    dst = dst.to(torch.int64)
    n = len(dst)
    layers = list(kv_layers(pool))
    H, D = layers[0][0].shape[1:]
    k = kv.k[:, :n].transpose(0, 1).reshape(n, len(layers) * H, D)
    k = shift_keys(k.to(layers[0][0].dtype), start, rope).reshape(n, len(layers), H, D)
    for layer, (k_buf, v_buf) in enumerate(layers):
        k_buf[dst] = k[:, layer]
        v_buf[dst] = kv.v[layer, :n].reshape(n, H, D).to(v_buf.dtype)


def _gather_record(scheduler, rec: SourceRecord, n: int, rope: RopeSpec) -> Optional[SegmentKV]:
    tree = scheduler.tree_cache
    found = tree.find_source(rec, n)
    if found is None or len(found[1]) < n:
        return None
    node, idx = found
    lock = tree.lock(node)
    try:
        return gather_canonical(scheduler.token_to_kv_pool_allocator.get_kvcache(), idx, rec.start, rope)
    finally:
        tree.unlock(lock)


def correct_segment(
    scheduler, req, st, index: int, span: Span, rec: SourceRecord, num_tokens: int, rope: RopeSpec, corrector
) -> Optional[InjectResult]:
    """Correct and inject ``num_tokens`` of ``span``; None when the segment is to be computed.

    Records the gate outcome in ``st.corrections[index]`` and, on a rejection, a
    ``PendingObservation`` in ``st.pending[index]``.
    """
    from sglang_kvshare.integration.state import context

    source = _gather_record(scheduler, rec, num_tokens, rope)
    if source is None:
        return None
    reference = None
    if st.method.needs_reference:
        ref_rec = st.reference(context().registry, span.slot)
        reference = None if ref_rec is None else _gather_record(scheduler, ref_rec, num_tokens, rope)
        if reference is None:
            return None
    result = corrector.correct(span.slot, rec.agent, st.spec.agent, source, reference)
    st.corrections[index] = {
        "gate": result.reason,
        "entropy": None if result.entropy is None else round(float(result.entropy), 6),
        "anchors": result.num_anchors,
        "corrected_rows": result.corrected_len,
    }
    if not result.accepted:
        st.pending[index] = PendingObservation(rec.agent, source, reference, num_tokens)
        return None
    dst = alloc_slots(scheduler, req, span.start, num_tokens)
    if dst is None:
        return None
    write_canonical(scheduler.token_to_kv_pool_allocator.get_kvcache(), dst, result.kv, span.start, rope)
    return InjectResult(num_tokens=num_tokens, source_agent=rec.agent, dst=dst)


def observe_fallbacks(tree, req, st, rope: RopeSpec, owned: int) -> None:
    """After a released request's dense fallbacks: hand their exact K/V (the first ``owned``
    tokens of the request are cached) to the corrector."""
    from sglang_kvshare.integration.state import context

    if not st.pending:
        return
    corrector = context().corrector(st.method.corrector, st.spec.tau)
    pool = tree.token_to_kv_pool_allocator.get_kvcache()
    row = tree.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
    for index, obs in st.pending.items():
        span = st.spec.spans[index]
        if span.start + obs.num_tokens > owned:
            continue
        idx = row[span.start : span.start + obs.num_tokens]
        target = gather_canonical(pool, idx, span.start, rope)
        corrector.observe(span.slot, obs.source_agent, st.spec.agent, obs.source, target, obs.reference)
    st.pending.clear()
    context().enforce_anchor_budget()
    st.anchor_bytes = corrector.nbytes()
