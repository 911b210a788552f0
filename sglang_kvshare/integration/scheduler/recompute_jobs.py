"""Selective recomputation, scheduler side: between two prefill chunks a shared segment with a
source cache becomes a :class:`~sglang_kvshare.recompute.job.RecomputeJob` holding the source's
K/V, keys re-aligned to the request's positions (``model/recompute_layer.py`` runs it). Ratio 0
is an injection (= fullshared), ratio 1 a dense prefill of the segment (= nonshared). A
correction method's partial fallback is a job too (``rows_job``): corrected K/V, fixed rows.
"""

from __future__ import annotations

from typing import Optional

import torch
from sglang.srt.models.llama import LlamaDecoderLayer

from sglang_kvshare.correction import SegmentKV
from sglang_kvshare.integration.cache.kv_io import gather_aligned, read_source
from sglang_kvshare.integration.scheduler.inject import inject_segment
from sglang_kvshare.recompute import SelectionInputs, get_selector
from sglang_kvshare.recompute.base import RecomputePlan
from sglang_kvshare.recompute.job import RecomputeJob
from sglang_kvshare.rope import RopeSpec, shift_keys

DEFAULT_RATIO = 0.1  # rho 0.9, the papers' default for agents that differ by system prompt
DEFAULT_LORA_RATIO = 0.3  # PReCache Sec. 4.1: 30% recomputation for LoRA agents


def recompute_ratio(spec_ratio: Optional[float], server_ratio: float, lora: bool) -> float:
    """The budget of a request: its own, else the server's (>= 0), else the papers' default."""
    if spec_ratio is not None:
        return float(spec_ratio)
    if server_ratio >= 0:
        return float(server_ratio)
    return DEFAULT_LORA_RATIO if lora else DEFAULT_RATIO


def unsupported(ses, scheduler) -> Optional[str]:
    """Why this scheduler's model cannot recompute a row subset of a segment (None: it can)."""
    runner = scheduler.tp_worker.model_runner
    if ses.runner is not runner:
        return "attention_backend"  # row subsets are attended by kvshare_torch only
    layers = getattr(getattr(runner.model, "model", None), "layers", None)
    if layers is None or not all(type(layer).forward is LlamaDecoderLayer.forward for layer in layers):
        return "model_not_supported"  # the hook runs the Llama family's decoder layer
    return None


def rows_job(start: int, kv: SegmentKV, rows, rope: RopeSpec, head_dim: int) -> RecomputeJob:
    """A job that keeps canonical ``kv`` (a corrected segment at position ``start``) except the
    row ranges ``rows``, recomputed in every layer (KVCMAS partial fallback)."""
    L, n, HD = kv.k.shape
    shape = (L, n, HD // head_dim, head_dim)
    k = shift_keys(kv.k.reshape(-1, *shape[2:]), start, rope).reshape(shape)
    mask = torch.zeros(L, n, dtype=torch.bool)
    for lo, hi in rows:
        mask[:, lo:hi] = True
    plan = RecomputePlan("rows", float(mask[0].float().mean()), mask, ((0, L),))
    return RecomputeJob(start, k, kv.v.reshape(shape), "rows", plan.ratio, plan=plan)


def start_job(ses, scheduler, req, st, span, rec, n: int, rope: RopeSpec, ratio: float):
    """A job for the first ``n`` tokens of ``span`` from source ``rec``; (job, reason) with
    job None when the segment must be computed densely (reason says why)."""
    reason = unsupported(ses, scheduler)
    if reason is not None:
        return None, reason
    num_layers = len(scheduler.tp_worker.model_runner.model.model.layers)
    hidden = None
    plan = None
    if st.method.selector == "droidspeak":
        prof = ses.profile(ses.args.droidspeak_profile, num_layers)
        plan = get_selector("droidspeak", profile=prof).plan(ratio, SelectionInputs(num_layers=num_layers, seg_len=n))
        if plan.is_dense:
            return None, "dense"
    needs_hidden = st.method.selector == "relaycaching" or (
        plan is not None and any(layer > 0 for layer in plan.hidden_state_entries())
    )
    if needs_hidden:
        tokens = req.full_untruncated_fill_ids[span.start : span.start + n]
        hidden = ses.hidden.get((st.spec.workflow, span.slot), tokens)
        if hidden is None:
            return None, "no_hidden_state"
    with read_source(scheduler.tree_cache, rec, n, whole=True) as src:
        if src is None:
            return None, "source_gone"
        pool = scheduler.token_to_kv_pool_allocator.get_kvcache()
        k, v = gather_aligned(pool, src, rec.start, span.start - rec.start, rope, ses.views)
        k, v = k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()
    job = RecomputeJob(span.start, k, v, st.method.selector, ratio, plan=plan, hidden=hidden)
    if plan is not None:
        job.layer_groups = plan.layer_groups
    return job, None


def plan_segment(ses, scheduler, req, st, index: int, span, rec, n: int, rope: RopeSpec):
    """Decide how ``n`` tokens of ``span`` are shared; returns the InjectResult of an injection
    (ratio 0) or None (the segment enters the next extend: a job, or dense). Records the
    request's ``recompute`` entry and mode."""
    ratio = recompute_ratio(st.spec.recompute_ratio, ses.args.recompute_ratio, req.lora_id is not None)
    num_layers = scheduler.token_to_kv_pool_allocator.get_kvcache().layer_num
    # token_layers: of the n tokens the source covers (the rest of the span is computed anyway)
    entry = {"recompute_ratio": ratio, "source_tokens": n, "token_layers": n * num_layers, "recomputed_token_layers": 0}
    st.recompute[index] = entry
    if ratio == 0.0:
        injected = inject_segment(ses, scheduler, req, span, rec, n, rope)
        if injected is not None:
            return injected
        job, reason = None, "injection_failed"  # source gone or no KV slots
    elif ratio == 1.0:
        job, reason = None, "dense"
    else:
        job, reason = start_job(ses, scheduler, req, st, span, rec, n, rope, ratio)
    if job is None:
        entry["recomputed_token_layers"] = n * num_layers
        st.modes[index] = "recomputed" if reason == "dense" else "computed"
        if reason != "dense":
            entry["reason"] = reason
        return None
    st.jobs[index] = job
    st.modes[index] = "recomputed"
    st.sources[index] = rec.agent
    return None
