"""Correction methods (KVCMAS, KVComm, GraphFlow, ...) applied inside the engine.

Between two prefill chunks, for a shared segment with a source cache:
1. gather the source's (and, for non-chained methods, the context-free reference's) K/V from the
   tree into canonical coordinates (keys rotated back so the segment starts at position 0);
2. ``Corrector.correct`` with the gate threshold of the method's ``TauController``: accepted ->
   the corrected cache is rotated to the request's positions and written into new slots, which
   become prefix of the next chunk (mode ``corrected``); rejected -> the segment is prefilled
   densely (mode ``dense_fallback``) and, when the request is released, its exact K/V are handed
   to the ``Observer``, which factorises them beside the scheduler into a new anchor.
   A sampled fraction of accepted corrections (``--kvshare-shadow-fraction``) is computed
   densely too: the corrected cache's error against the exact one goes to the controller.
   With ``--kvshare-fallback rows`` a rejected segment is gated again per block of rows: one
   with some accepted blocks enters the next extend as a recompute job (``recompute_jobs.rows_job``)
   that keeps the corrected rows and recomputes the rejected ones in every layer, attending the
   rows before them; its K/V are then observed like a dense fallback's, so the pools learn.
   Head rows (``--kvshare-recompute-head``, ``ReqShareState.share_at``): the chunk before the
   segment computed its first rows densely; only the rows after them are corrected and written.

On CUDA the write is the fused ``kernels.kv_correct`` (gather, re-align, add the delta, write);
on the CPU the corrected cache is materialised and written with one rotation for all layers.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass
from typing import Optional

import torch

from sglang_kvshare.correction import SegmentKV
from sglang_kvshare.correction.base import apply_delta, relative_error
from sglang_kvshare.integration.cache.kv_io import (
    InjectResult,
    alloc_slots,
    gather_canonical,
    kv_bytes_per_token,
    kv_layers,
    read_source,
    write_canonical,
    write_fused,
)
from sglang_kvshare.integration.cache.leaves import leaf_factors, uniform_offset
from sglang_kvshare.integration.cache.views import viewable
from sglang_kvshare.integration.scheduler.recompute_jobs import rows_job, unsupported
from sglang_kvshare.rope import RopeSpec
from sglang_kvshare.segments import Span
from sglang_kvshare.segments.sources import SourceRecord


@dataclass
class PendingObservation:
    """What ``observe`` needs after a dense fallback, kept until the exact KV exists.

    shadow: for a shadowed accepted correction, the corrected cache to measure (and the gate
    entropy it was accepted with)."""

    source_agent: str
    source: SegmentKV
    reference: Optional[SegmentKV]
    num_tokens: int
    shadow: Optional[SegmentKV] = None
    entropy: Optional[float] = None


def correct_segment(
    ses,
    scheduler,
    req,
    st,
    index: int,
    span: Span,
    rec: SourceRecord,
    num_tokens: int,
    rope: RopeSpec,
    corrector,
    fused: Optional[bool] = None,
) -> Optional[InjectResult]:
    """Correct and inject ``num_tokens`` of ``span``; None when the segment is to be computed.

    Records the gate outcome in ``st.corrections[index]`` and, on a rejection (or a shadowed
    acceptance), a ``PendingObservation`` in ``st.pending[index]``. ``fused``: write through
    ``kernels.kv_correct`` (default: when the KV pool is on CUDA).
    """
    tree = scheduler.tree_cache
    pool = scheduler.token_to_kv_pool_allocator.get_kvcache()
    ref_rec = st.reference(ses.registry, span.slot) if st.method.needs_reference else None
    with ExitStack() as held:
        src = held.enter_context(read_source(tree, rec, num_tokens, whole=True))
        if src is None:
            return None
        ref = None
        if st.method.needs_reference:
            ref = None if ref_rec is None else held.enter_context(read_source(tree, ref_rec, num_tokens, whole=True))
            if ref is None:
                return None
        source = gather_canonical(pool, src, rec.start, rope, ses.views, rec.agent)
        reference = (
            gather_canonical(pool, ref, ref_rec.start, rope, ses.views, ref_rec.agent) if ref is not None else None
        )
        if fused is None:
            fused = src.is_cuda
        controller = ses.tau_controller(st.method.corrector, st.spec.target_rho)
        tau = st.spec.tau if st.spec.tau is not None else controller.tau()
        result = corrector.correct(
            span.slot,
            rec.agent,
            st.spec.agent,
            source,
            reference,
            materialize=False,
            tau=tau,
            block_size=ses.gate_block(st.spec),
        )
        record = {
            "gate": result.reason,
            "entropy": None if result.entropy is None else round(float(result.entropy), 6),
            "tau": round(float(tau), 6),
            "anchors": result.num_anchors,
            "corrected_rows": result.corrected_len,
        }
        if result.anchor_bytes_per_token is not None:
            record["anchor_bytes_per_token"] = round(result.anchor_bytes_per_token, 1)
        if result.blocks:  # partial fallback: the gate per block of rows
            record["block_size"] = result.blocks[0].hi - result.blocks[0].lo
            record["block_entropies"] = [round(float(b.entropy), 4) for b in result.blocks]
            record["rejected_blocks"] = sum(not b.accepted for b in result.blocks)
        st.kv_bytes_per_token = kv_bytes_per_token(pool)
        st.corrections[index] = record
        k = result.corrected_len
        head = st.heads.get(index, 0)  # rows the chunk before computed densely (``share_at``)
        if result.entropy is not None:  # head rows count as not reused (tuning.TauController)
            controller.observe_gate(result.entropy, num_tokens, head)
        if head:
            record["recomputed_head"] = record["recomputed_rows"] = head
        rejected = tuple((max(lo, head), hi) for lo, hi in result.rejected_rows if hi > head)
        if rejected:
            unsupported_reason = unsupported(ses, scheduler)
            if unsupported_reason is None:  # the segment enters the next extend as a job
                _recompute_rows(ses, st, index, span, rec, source, reference, result, rejected, num_tokens, rope, pool)
                return None
            record["rows_fallback"] = unsupported_reason  # the segment is prefilled densely instead
        shadow = (
            result.accepted
            and not rejected
            and ses.args.shadow_fraction > 0
            and ses.rng.random() < ses.args.shadow_fraction
        )
        if not result.accepted or shadow or rejected:
            corrected = None
            if shadow:
                record["shadow"] = True
                corrected = apply_delta(reference or source, source, result.delta, result.corrected_len)
            st.pending[index] = PendingObservation(rec.agent, source, reference, num_tokens, corrected, result.entropy)
            return None
        if not fused and reference is None:  # the source's slots in place, the correction as a leaf
            viewed = _read_with_leaf(ses, st, record, rec, src, result.delta, head, k, num_tokens, rope, pool)
            if viewed is not None:
                return InjectResult(num_tokens=num_tokens - head, source_agent=rec.agent, dst=viewed)
        # rows past the corrected ones are the source's, unchanged: read in place (KV views)
        k = max(k, head)
        in_place = (
            num_tokens - k
            if not fused
            and viewable(ses.views, st.spec, num_tokens - k)
            and ses.views.readable(rec.agent, st.spec, src[k:num_tokens])
            else 0
        )
        at = span.start + head
        dst = alloc_slots(scheduler, req, at, num_tokens - head - in_place)
        if dst is None:
            return None
        record["copy_runs"] = int((dst[1:] - dst[:-1] != 1).sum()) + 1 if len(dst) else 0  # contiguous slot runs
        if in_place:
            viewed = ses.views.read_in_place(
                st, src[k:num_tokens], torch.arange(rec.start + k, rec.start + num_tokens), rec.agent
            )
            dst = torch.cat([dst.to(viewed.dtype), viewed])
        if fused:
            base_idx, base_start = (ref, ref_rec.start) if ref is not None else (src, rec.start)
            rows = torch.cat([base_idx[head:k], src[k:num_tokens]])
            ar = torch.arange(head, num_tokens, device=rows.device)
            positions = torch.where(ar < k, base_start + ar, rec.start + ar)
            write_fused(pool, dst, rows, positions, result.delta, result.corrected_len, span.start, rope, first=head)
        else:  # the gathered source is ours: correct it in place and write the rows not viewed
            kv = apply_delta(reference or source, source, result.delta, result.corrected_len, inplace=True)
            rest = slice(head, num_tokens - in_place)  # canonical rows: moved by the segment's start
            kv = SegmentKV(kv.k[:, rest], kv.v[:, rest])
            write_canonical(pool, dst[: num_tokens - head - in_place], kv, span.start, rope)
    return InjectResult(num_tokens=num_tokens - head, source_agent=rec.agent, dst=dst)


def _leaf_wanted(ses, st, k: int) -> Optional[bool]:
    """Whether an accepted correction of ``k`` rows is to be kept as a KV leaf: None where leaves
    do not apply (no views with leaves, copy mode, ``leaves: false``); else True where asked for
    (``leaves: true``, ``--kvshare-leaf-policy always``) or, under the policy ``pressure``, where
    the pool cannot hold the copy without evicting a source read again."""
    if ses.views is None or ses.views.leaves is None or st.spec.kv_views is False or st.spec.leaves is False:
        return None
    return st.spec.leaves is True or ses.args.leaf_policy != "pressure" or not ses.tree.copies_fit(k)


def _read_with_leaf(ses, st, record, rec, src, delta, head: int, k: int, n: int, rope, pool) -> Optional[torch.Tensor]:
    """An accepted correction of rows ``head:k`` of ``n`` (rows before ``head`` were computed)
    kept as KV view + leaf (``cache/leaves.py``): the request reads the source's slots, which it
    returns, with the correction (and any leaf the source agent reads them with) as a rank
    ``--kvshare-leaf-rank`` leaf. None where it cannot or should not: leaves off, copy mode or
    no leaves asked for, the pool holds the copy without evicting a source read again
    (``--kvshare-leaf-policy pressure``, ``_leaf_wanted``), the agent already has a leaf on these
    slots, or the segment's keys do not carry RoPE at one offset from its rows."""
    leaf = _leaf_wanted(ses, st, max(k - head, 0))
    if not leaf:
        if leaf is False:
            record["kept_as"] = "copy"
        return None
    views = ses.views
    leaves = views.leaves
    slots = src[head:n]
    if leaves.has(st.spec.agent, slots):
        return None
    p0 = uniform_offset(views.rope_pos[src[:n]], rec.start)  # RoPE position of canonical row 0
    if p0 is None:
        return None
    k_buf = next(kv_layers(pool))[0]
    head_dim = k_buf.shape[-1]
    inherited = leaves.has(rec.agent, slots)
    rows = n - head if inherited else max(k - head, 0)
    if rows:
        dk, dv = delta.k[:, head:k], delta.v[:, head:k]
        if inherited:  # the source agent's leaf (turned to the canonical frame) and this correction on top
            dk, dv = (torch.cat([d, d.new_zeros(d.shape[0], rows - d.shape[1], d.shape[2])], 1) for d in (dk, dv))
            leaves.add_to(rec.agent, slots, dk, dv, key_shift=-p0, rope=rope, head_dim=head_dim)
        fk, fv = leaf_factors(dk, dv, p0, views.leaf_rank, rope, head_dim, k_buf.dtype)
        leaves.attach(st.spec.agent, slots[:rows], fk, fv)
        record.update(kept_as="leaf", leaf_rank=fk.rank, leaf_bytes=fk.nbytes + fv.nbytes)
    return views.read_in_place(st, slots, torch.arange(rec.start + head, rec.start + n), rec.agent)


def _recompute_rows(ses, st, index, span, rec, source, reference, result, rows, num_tokens, rope, pool) -> None:
    """Partial fallback: the corrected segment enters the next extend as a recompute job whose
    row ranges ``rows`` (the rejected blocks) run every layer, attending the corrected rows
    before them (rows before the head, ``st.heads``, were computed by the chunk before and are
    not in the extend). Once the request is released its K/V (corrected and recomputed rows)
    are observed like a dense fallback's, with probability the recomputed fraction: the observer
    (a factorisation of the whole segment) then runs about as often per recomputed row as under
    the dense fallback."""
    kv = apply_delta(reference or source, source, result.delta, result.corrected_len)
    head_dim = next(kv_layers(pool))[0].shape[-1]
    job = rows_job(span.start, SegmentKV(kv.k[:, :num_tokens], kv.v[:, :num_tokens]), rows, rope, head_dim)
    head = st.heads.get(index, 0)
    recomputed = sum(hi - lo for lo, hi in rows)
    st.corrections[index]["recomputed_rows"] = head + recomputed
    st.jobs[index] = job
    st.modes[index] = "corrected"
    st.injected[index] = num_tokens - head - recomputed
    st.reused_in_extend += num_tokens - head - recomputed
    observed = ses.rng.random() < (head + recomputed) / num_tokens
    st.corrections[index]["observed"] = observed
    if observed:
        st.pending[index] = PendingObservation(rec.agent, source, reference, num_tokens)


def observe_fallbacks(ses, tree, req, st, rope: RopeSpec, owned: int) -> None:
    """After a released request's dense fallbacks: hand their exact K/V (the first ``owned``
    tokens of the request are cached) to the corrector, through the observer."""
    if not st.pending:
        return
    corrector = ses.corrector(st.method.corrector)
    controller = ses.tau_controller(st.method.corrector, st.spec.target_rho)
    pool = tree.token_to_kv_pool_allocator.get_kvcache()
    row = tree.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
    for index, obs in st.pending.items():
        span = st.spec.spans[index]
        if span.start + obs.num_tokens > owned:
            continue
        idx = row[span.start : span.start + obs.num_tokens]
        target = gather_canonical(pool, idx, span.start, rope, ses.views, st.spec.agent)
        if obs.shadow is not None:
            error = relative_error(obs.shadow, target)
            controller.observe_error(obs.entropy, error)
            st.corrections[index]["shadow_error"] = round(error, 6)

        def record(prepared, corrector=corrector):
            ses.enforce_anchor_budget(keep=[corrector.record(prepared)])

        ses.observer.submit(
            corrector, (span.slot, obs.source_agent, st.spec.agent, obs.source, target, obs.reference), record
        )
    st.pending.clear()
    st.anchor_bytes = corrector.nbytes()
