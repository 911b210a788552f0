"""Selective recomputation, scheduler side: between two prefill chunks a shared segment with a
source cache becomes a :class:`RecomputeJob` holding the source's K/V, keys re-aligned to the
request's positions (``recompute_forward`` runs it). Ratio 0 is an injection (= fullshared),
ratio 1 a dense prefill of the segment (= nonshared).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from sglang_kvshare.integration.hidden_store import StoredHidden
from sglang_kvshare.integration.injection import inject_segment
from sglang_kvshare.integration.kv_io import gather_aligned, read_source
from sglang_kvshare.integration.plugin import session
from sglang_kvshare.recompute import DroidSpeakProfile, RecomputePlan, SelectionInputs, get_selector
from sglang_kvshare.rope import RopeSpec

DEFAULT_RATIO = 0.1  # rho 0.9, the papers' default for agents that differ by system prompt
DEFAULT_LORA_RATIO = 0.3  # PReCache Sec. 4.1: 30% recomputation for LoRA agents


def recompute_ratio(spec_ratio: Optional[float], server_ratio: float, lora: bool) -> float:
    """The budget of a request: its own, else the server's (>= 0), else the papers' default."""
    if spec_ratio is not None:
        return float(spec_ratio)
    if server_ratio >= 0:
        return float(server_ratio)
    return DEFAULT_LORA_RATIO if lora else DEFAULT_RATIO


# ---------------------------------------------------------------------------------------------
# the DroidSpeak profile


def profile_of(layer_deviation) -> DroidSpeakProfile:
    """A profile whose mean layer deviation is ``layer_deviation``."""
    dev = [float(x) for x in layer_deviation]
    return DroidSpeakProfile.from_state_dict(
        {"num_layers": len(dev), "relative": True, "sum": dev, "num_samples": 1}
    )


def load_profile(path: str, num_layers: int) -> DroidSpeakProfile:
    """A profile JSON written by ``benchmarks.coverage`` (``{"layer_deviation": [...]}``)."""
    prof = profile_of(json.loads(Path(path).read_text())["layer_deviation"])
    if prof.num_layers != num_layers:
        raise ValueError(f"DroidSpeak profile {path} has {prof.num_layers} layers, the model has {num_layers}")
    return prof


# ---------------------------------------------------------------------------------------------
# jobs


@dataclass
class RecomputeJob:
    """One shared segment of a request whose KV is reused and partly recomputed."""

    start: int  # position of the segment's first token
    # [num_layers, n, kv_heads, head_dim] reused K/V at the request's positions; None once the
    # forward that reached the segment's last token has used them
    k: Optional[torch.Tensor]
    v: Optional[torch.Tensor]
    selector: str
    ratio: float
    plan: Optional[RecomputePlan] = None  # DroidSpeak: fixed before the forward
    hidden: Optional[StoredHidden] = None
    token_layers: int = 0  # token-layers executed so far (check pass included)
    layer_groups: tuple = ()
    n: int = 0
    num_layers: int = 0

    def __post_init__(self) -> None:
        self.num_layers, self.n = int(self.k.shape[0]), int(self.k.shape[1])

    def release(self) -> None:
        self.k = self.v = self.hidden = None


def start_job(scheduler, req, st, span, rec, n: int, rope: RopeSpec, ratio: float):
    """A job for the first ``n`` tokens of ``span`` from source ``rec``; (job, reason) with
    job None when the segment must be computed densely (reason says why)."""
    from sglang.srt.models.llama import LlamaDecoderLayer

    ses = session()
    runner = scheduler.tp_worker.model_runner
    if ses.runner is not runner:
        return None, "attention_backend"  # row subsets are attended by kvshare_torch only
    model = runner.model
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or not all(type(l).forward is LlamaDecoderLayer.forward for l in layers):
        return None, "model_not_supported"  # the hook runs the Llama family's decoder layer
    num_layers = len(layers)
    hidden = None
    plan = None
    if st.method.selector == "droidspeak":
        prof = ses.profile(ses.args.droidspeak_profile, num_layers)
        plan = get_selector("droidspeak", profile=prof).plan(
            ratio, SelectionInputs(num_layers=num_layers, seg_len=n)
        )
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
        k, v = gather_aligned(pool, src, span.start - rec.start, rope)
        k, v = k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()
    job = RecomputeJob(span.start, k, v, st.method.selector, ratio, plan=plan, hidden=hidden)
    if plan is not None:
        job.layer_groups = plan.layer_groups
    return job, None


def plan_segment(scheduler, req, st, index: int, span, rec, n: int, rope: RopeSpec):
    """Decide how ``n`` tokens of ``span`` are shared; returns the InjectResult of an injection
    (ratio 0) or None (the segment enters the next extend: a job, or dense). Records the
    request's ``recompute`` entry and mode."""
    ratio = recompute_ratio(st.spec.recompute_ratio, session().args.recompute_ratio, req.lora_id is not None)
    num_layers = scheduler.token_to_kv_pool_allocator.get_kvcache().layer_num
    # token_layers: of the n tokens the source covers (the rest of the span is computed anyway)
    entry = {"recompute_ratio": ratio, "source_tokens": n, "token_layers": n * num_layers,
             "recomputed_token_layers": 0}
    st.recompute[index] = entry
    if ratio == 0.0:
        injected = inject_segment(scheduler, req, span, rec, n, rope)
        if injected is not None:
            return injected
        job, reason = None, "injection_failed"  # source gone or no KV slots
    elif ratio == 1.0:
        job, reason = None, "dense"
    else:
        job, reason = start_job(scheduler, req, st, span, rec, n, rope, ratio)
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
