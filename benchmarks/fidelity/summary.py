"""Per-label summary of the fidelity benchmark's runs (``aggregate``), as a typed record."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence

from benchmarks.fidelity.records import RunRecord, TurnRecord
from benchmarks.fidelity_metrics import REUSED_MODES, KvError, mean, pooled


@dataclass(frozen=True)
class EntropyStats:
    """Gate entropies of one slot kind over the later agents' segments."""

    n: int
    p10: Optional[float]
    p50: Optional[float]
    p90: Optional[float]
    max: Optional[float]
    distinct: int


@dataclass(frozen=True)
class MethodSummary:
    """One label's runs summarised; the fields are the keys of ``main`` / ``tau_sweep`` in the
    results JSON (see the package docstring). ``*_by_position``: by agent position."""

    tasks: int
    failed_tasks: int
    turns: int
    shadowed_turns: int
    rho: Optional[float]
    rho_all: Optional[float]
    rho_by_position: Dict[int, Optional[float]]
    reused_segments: int
    kv_err_mean: Optional[float]
    kv_err_pooled: Optional[float]
    kv_err_k_pooled: Optional[float]
    kv_err_v_pooled: Optional[float]
    kv_err_max: Optional[float]
    # the same split by slot kind: the question (long, context-only) vs agent outputs (short)
    kv_err_q_pooled: Optional[float]
    kv_err_out_pooled: Optional[float]
    reused_segments_q: int
    reused_segments_out: int
    kv_err_all_shared_mean: Optional[float]
    kv_err_all_shared_pooled: Optional[float]
    kv_err_by_position: Dict[int, Optional[float]]
    dump_missing_or_mismatch: int
    prompt_mismatch_turns: int
    kl_mean: Optional[float]
    kl_mean_later: Optional[float]
    kl_max: Optional[float]
    kl_by_position: Dict[int, Optional[float]]
    kl_methods: Dict[Optional[str], int]
    dense_rest_mass_mean: Optional[float]
    top1_agree: Optional[float]
    exact_match: Optional[float]
    exact_match_later: Optional[float]
    lead_agree: Optional[float]
    lead_agree_later: Optional[float]
    anchor_bytes: Optional[int]
    anchor_bytes_reported_turns: int
    computed_tokens: int
    # prompt tokens not computed by the non-first agents (cached prefix, injected, corrected)
    prompt_reuse_later: Optional[float]
    rebuild_tokens: int
    # selective recomputation: token-layers of the reused (source-covered) shared tokens
    recomputed_token_layers: int
    shared_token_layers: int
    kv_bytes_per_token: Optional[int]
    lr_bytes_per_token_per_agent: Optional[int]
    prompt_tokens: int
    reference_tokens: int
    computed_by_position: Dict[int, int]
    corrections_accepted: int
    corrections_rejected: int
    gates: Dict[str, int]
    entropy_q: Optional[EntropyStats]
    entropy_out: Optional[EntropyStats]
    modes_later: Dict[str, int]
    accuracy: Optional[float]
    mean_turn_latency_s: Optional[float]

    @property
    def token_layer_rho(self) -> Optional[float]:
        """Realised token-layer reuse of the later agents, ``1 - recomputed / shared token-layers``."""
        total = self.shared_token_layers or 0
        return round(1.0 - self.recomputed_token_layers / total, 4) if total else None

    def to_json(self) -> Dict[str, Any]:
        return asdict(self)


def _r(x, nd=4):
    return None if x is None else round(x, nd)


def _errs(runs: Sequence[RunRecord], positions=None, modes=REUSED_MODES, kind=None) -> List[KvError]:
    """KV errors of the shared segments of ``runs`` in ``modes`` (None: all); ``kind``: "q" (the
    question slot) or "out" (agent outputs)."""
    out = []
    for r in runs:
        for t in r.turns:
            if t.shadow is None or (positions is not None and t.position not in positions):
                continue
            for e in t.shadow.seg_errors or ():
                if e.error is None or (modes is not None and e.mode not in modes):
                    continue
                if kind is not None and (e.slot == "q") != (kind == "q"):
                    continue
                out.append(e.error)
    return out


def _ratio(ts: Sequence[TurnRecord]) -> Optional[float]:
    tot = sum(t.shared_tokens for t in ts)
    return _r(sum(t.shared_reused for t in ts) / tot) if tot else None


def _entropies(later: Sequence[TurnRecord], kind: str) -> Optional[EntropyStats]:
    """Gate entropies of one slot kind (``q``: the question, ``out``: agent outputs)."""
    vals = sorted(
        s["entropy"]
        for t in later
        for s in t.segments
        if s.get("entropy") is not None and (s["slot"] == "q") == (kind == "q")
    )
    if not vals:
        return None

    def q(f):
        return vals[min(len(vals) - 1, int(f * len(vals)))]

    return EntropyStats(len(vals), _r(q(0.1)), _r(q(0.5)), _r(q(0.9)), _r(vals[-1]), len(set(vals)))


def _seg_sum(turns: Iterable[TurnRecord], key: str) -> int:
    return sum(s.get(key) or 0 for t in turns for s in t.segments)


def _max_or_none(values: Iterable[Optional[int]]) -> Optional[int]:
    return max((v or 0 for v in values), default=0) or None


def aggregate(runs: Sequence[Any]) -> MethodSummary:
    """Summary of the runs of one label (method[@tau]); failed runs are only counted."""
    ok = [r for r in runs if isinstance(r, RunRecord)]
    turns = [t for r in ok for t in r.turns]
    later = [t for t in turns if t.position > 0]
    positions = sorted({t.position for t in turns})
    shadowed = [t for t in turns if t.shadow is not None]
    sh = [t.shadow for t in shadowed]
    sh_later = [t.shadow for t in shadowed if t.position > 0]
    reused = _errs(ok)
    all_shared = _errs(ok, modes=None)
    anchor = [t.anchor_bytes for t in turns if t.anchor_bytes is not None]
    return MethodSummary(
        tasks=len(ok),
        failed_tasks=len(runs) - len(ok),
        turns=len(turns),
        shadowed_turns=len(shadowed),
        rho=_ratio(later),
        rho_all=_ratio(turns),
        rho_by_position={p: _ratio([t for t in turns if t.position == p]) for p in positions},
        reused_segments=len(reused),
        kv_err_mean=_r(mean(e.rel for e in reused)),
        kv_err_pooled=_r(pooled(reused)),
        kv_err_k_pooled=_r(pooled(reused, "k_")),
        kv_err_v_pooled=_r(pooled(reused, "v_")),
        kv_err_max=_r(max((e.rel for e in reused), default=None)),
        kv_err_q_pooled=_r(pooled(_errs(ok, kind="q"))),
        kv_err_out_pooled=_r(pooled(_errs(ok, kind="out"))),
        reused_segments_q=len(_errs(ok, kind="q")),
        reused_segments_out=len(_errs(ok, kind="out")),
        kv_err_all_shared_mean=_r(mean(e.rel for e in all_shared)),
        kv_err_all_shared_pooled=_r(pooled(all_shared)),
        kv_err_by_position={p: _r(pooled(_errs(ok, {p}))) for p in positions},
        dump_missing_or_mismatch=sum(1 for s in sh for e in s.seg_errors or () if e.missing or e.mismatch),
        prompt_mismatch_turns=sum(1 for s in sh if not s.prompt_match),
        kl_mean=_r(mean(s.kl for s in sh), 5),
        kl_mean_later=_r(mean(s.kl for s in sh_later), 5),
        kl_max=_r(max((s.kl for s in sh if s.kl is not None), default=None), 5),
        kl_by_position={p: _r(mean(t.shadow.kl for t in shadowed if t.position == p), 5) for p in positions},
        kl_methods=dict(Counter(s.kl_method for s in sh)),
        dense_rest_mass_mean=_r(mean(s.dense_rest_mass for s in sh), 5),
        top1_agree=_r(mean(float(s.top1_agree) for s in sh if s.top1_agree is not None)),
        exact_match=_r(mean(float(s.exact_match) for s in sh)),
        exact_match_later=_r(mean(float(s.exact_match) for s in sh_later)),
        lead_agree=_r(mean(s.lead_agree for s in sh)),
        lead_agree_later=_r(mean(s.lead_agree for s in sh_later)),
        anchor_bytes=max(anchor) if anchor else None,
        anchor_bytes_reported_turns=len(anchor),
        computed_tokens=sum(t.computed_tokens or 0 for t in turns),
        prompt_reuse_later=_r(
            1.0 - sum(t.computed_tokens or 0 for t in later) / max(1, sum(t.prompt_tokens or 0 for t in later))
        ),
        rebuild_tokens=sum(t.rebuild_tokens or 0 for t in turns),
        recomputed_token_layers=_seg_sum(later, "recomputed_token_layers"),
        shared_token_layers=_seg_sum(later, "token_layers"),
        kv_bytes_per_token=_max_or_none(t.kv_bytes_per_token for t in turns),
        lr_bytes_per_token_per_agent=_max_or_none(t.lr_bytes_per_token_per_agent for t in turns),
        prompt_tokens=sum(t.prompt_tokens or 0 for t in turns),
        reference_tokens=sum(t.reference_tokens or 0 for t in turns),
        computed_by_position={p: sum(t.computed_tokens or 0 for t in turns if t.position == p) for p in positions},
        corrections_accepted=sum(t.corrections_accepted for t in turns),
        corrections_rejected=sum(t.corrections_rejected for t in turns),
        gates=dict(Counter(s.get("gate") for t in turns for s in t.segments if s.get("gate"))),
        entropy_q=_entropies(later, "q"),
        entropy_out=_entropies(later, "out"),
        modes_later=dict(Counter(s.get("mode") for t in later for s in t.segments)),
        accuracy=_r(mean(float(r.correct) for r in ok)),
        mean_turn_latency_s=_r(mean(t.latency_s for t in turns), 3),
    )
