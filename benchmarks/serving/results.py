"""The serving benchmark's results as frozen dataclasses. Their field names are the keys of the JSON
the run writes (``to_json``): one method at one point (``PointResult``), the methods of one point
with their ratios to nonshared (``Point``), one method's closed-loop capacity (``CapacityRow``),
and what a run measured on one server (``Part``; ``merge_parts`` joins the servers of a run)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any, Dict, List, Mapping, Optional, Tuple

from benchmarks.client import Percentiles
from benchmarks.serving.workload import BASELINE

Ratios = Dict[str, Dict[str, Optional[float]]]  # method -> {metric: method / nonshared}


@dataclass(frozen=True)
class PointResult:
    """One method at one point (see the package's docstring for each metric)."""

    context: int
    rate: float
    method: str
    agents: int
    rounds: int
    workflows: int
    output_len: int
    requests: int  # completed
    errors: int
    error_messages: Tuple[str, ...]  # the first five
    kvshare_missing: int  # completed requests without meta_info.kvshare
    ttft_s: Optional[Percentiles]
    ttft_later_s: Optional[Percentiles]  # turns after the first
    ttft_fallback_s: Optional[Percentiles]  # later turns with a rejected segment or recomputed rows
    fallback_turns: int
    recomputed_rows: int
    e2e_s: Optional[Percentiles]
    workflow_latency_s: Optional[Percentiles]
    makespan_s: Optional[float]
    achieved_wf_per_s: Optional[float]  # completed workflows / makespan
    steady_wf_per_s: Optional[float]  # between the first and the last completion
    output_tokens: Optional[int]
    prompt_tokens: Optional[int]
    computed_tokens: Optional[int]
    reused_tokens: Optional[int]
    shared_tokens: Optional[int]
    output_tok_s: Optional[float]
    total_tok_s: Optional[float]
    injected_tokens: Optional[int]
    rho: Optional[float]
    rho_injected: Optional[float]
    rho_later: Optional[float]
    corrections_accepted: int
    corrections_rejected: int
    gates: Dict[str, int]
    kept_as: Dict[str, int]  # accepted corrections kept as a KV leaf or a copy (--kvshare-leaf-policy)
    correction_ms: Optional[Percentiles]
    anchor_bytes_per_token: Optional[float]
    kv_bytes_per_token: Optional[float]
    rss_baseline_mb: Optional[float]
    peak_rss_mb: Optional[float]
    peak_rss_delta_mb: Optional[float]
    peak_gpu_mb: Optional[float]
    peak_kv_tokens: Optional[float]
    peak_kv_mb: Optional[float]
    workers_memory: Optional[Dict[str, Dict[str, Optional[float]]]]  # behind a router: per worker
    requests_log: Tuple[Dict[str, Any], ...] = field(default=(), repr=False)  # to the run's timeline, not here
    saturated: Optional[bool] = None  # set by the rate sweep only

    def to_json(self) -> Dict[str, Any]:
        out = asdict(self)
        del out["requests_log"]
        if self.saturated is None:
            del out["saturated"]
        return out

    def ratio_metrics(self) -> Dict[str, Optional[float]]:
        """The metrics compared against nonshared, by their key in a point's ``ratios``."""
        ttft, later, e2e, wf = self.ttft_s, self.ttft_later_s, self.e2e_s, self.workflow_latency_s
        return {
            "ttft_s.p50": ttft and ttft.p50,
            "ttft_s.p90": ttft and ttft.p90,
            "ttft_s.p99": ttft and ttft.p99,
            "ttft_later_s.p50": later and later.p50,
            "e2e_s.p50": e2e and e2e.p50,
            "workflow_latency_s.p50": wf and wf.p50,
            "output_tok_s": self.output_tok_s,
            "total_tok_s": self.total_tok_s,
            "peak_rss_mb": self.peak_rss_mb,
            "peak_rss_delta_mb": self.peak_rss_delta_mb,
            "peak_gpu_mb": self.peak_gpu_mb,
            "peak_kv_tokens": self.peak_kv_tokens,
            "computed_tokens": self.computed_tokens,
        }


def ratio_table(values: Mapping[str, Mapping[str, Optional[float]]]) -> Ratios:
    """method -> {metric: its value / nonshared's} (None where either is unknown or nonshared's is
    0; {} without nonshared)."""
    base = values.get(BASELINE)
    if base is None:
        return {}
    return {
        m: {k: (v / base.get(k)) if v is not None and base.get(k) not in (None, 0) else None for k, v in row.items()}
        for m, row in values.items()
    }


def ratios(by_method: Mapping[str, PointResult]) -> Ratios:
    return ratio_table({m: r.ratio_metrics() for m, r in by_method.items()})


@dataclass(frozen=True)
class Point:
    """Every method at one (context, rate, agents, rounds)."""

    context: int
    rate: float
    agents: int
    rounds: int
    methods: Dict[str, PointResult]

    @property
    def key(self) -> Tuple[int, float, int, int]:
        return self.context, self.rate, self.agents, self.rounds

    @property
    def ratios(self) -> Ratios:
        return ratios(self.methods)

    def to_json(self) -> Dict[str, Any]:
        return {
            "context": self.context,
            "rate": self.rate,
            "agents": self.agents,
            "rounds": self.rounds,
            "methods": {m: r.to_json() for m, r in self.methods.items()},
            "ratios": self.ratios,
        }


@dataclass(frozen=True)
class CapacityRow:
    """One method's closed loop at one context: ``wf_per_s`` in the steady window, the later
    agents' TTFT and rho, and (``vs_nonshared``) its wf/s over nonshared's at that context."""

    wf_per_s: Optional[float]
    wf_per_s_makespan: Optional[float]
    ttft_later_p50_s: Optional[float]
    rho_later: Optional[float]
    ttft_later_p90_s: Optional[float]
    ttft_fallback_p90_s: Optional[float]
    fallback_turns: int
    recomputed_rows: int
    correction_ms_p50: Optional[float]
    gates: Dict[str, int]
    kept_as: Dict[str, int]
    workflow_latency_p50_s: Optional[float]
    errors: int
    vs_nonshared: Optional[float] = None

    @classmethod
    def of(cls, res: PointResult) -> "CapacityRow":
        later, fallback, corr, wf = res.ttft_later_s, res.ttft_fallback_s, res.correction_ms, res.workflow_latency_s
        return cls(
            wf_per_s=res.steady_wf_per_s,
            wf_per_s_makespan=res.achieved_wf_per_s,
            ttft_later_p50_s=later and later.p50,
            rho_later=res.rho_later,
            ttft_later_p90_s=later and later.p90,
            ttft_fallback_p90_s=fallback and fallback.p90,
            fallback_turns=res.fallback_turns,
            recomputed_rows=res.recomputed_rows,
            correction_ms_p50=corr and corr.p50,
            gates=res.gates,
            kept_as=res.kept_as,
            workflow_latency_p50_s=wf and wf.p50,
            errors=res.errors,
        )


Capacity = Dict[str, Dict[str, CapacityRow]]  # context (a string, as in the JSON) -> method -> row


def capacity_ratios(cap: Capacity) -> Capacity:
    """The rows with ``vs_nonshared`` set (their wf/s over nonshared's at that context)."""
    out: Capacity = {}
    for ctx, rows in cap.items():
        base = rows[BASELINE].wf_per_s if BASELINE in rows else None
        out[ctx] = {
            m: replace(row, vs_nonshared=(row.wf_per_s / base) if base and row.wf_per_s else None)
            for m, row in rows.items()
        }
    return out


@dataclass(frozen=True)
class Part:
    """What a run measured on one server: the rate sweep's points and the rates it skipped, the
    capacity rows, the scaling sweeps' points (by ``agents`` and ``rounds``), and every request
    in the order it ran (``timeline``: warm-up and pre-serve included)."""

    points: Tuple[Point, ...]
    skipped: Tuple[Dict[str, Any], ...]
    capacity: Capacity
    scaling: Dict[str, Tuple[Point, ...]]
    timeline: Tuple[Dict[str, Any], ...]

    def to_json(self) -> Dict[str, Any]:
        """The JSON's ``qps_sweep``, ``saturation``, ``skipped``, ``capacity``, ``timeline`` and ``scaling``."""
        return {
            "qps_sweep": [p.to_json() for p in self.points],
            "saturation": saturation(self.points),
            "skipped": list(self.skipped),
            "capacity": {ctx: {m: asdict(row) for m, row in rows.items()} for ctx, rows in self.capacity.items()},
            "timeline": list(self.timeline),
            "scaling": {kind: [p.to_json() for p in pts] for kind, pts in self.scaling.items()},
        }


def _join(lists: List[Tuple[Point, ...]]) -> Tuple[Point, ...]:
    """Points of the same (context, rate, agents, rounds) as one, their methods in the order met."""
    merged: Dict[tuple, Point] = {}
    for pts in lists:
        for p in pts:
            old = merged.get(p.key)
            merged[p.key] = p if old is None else replace(old, methods={**old.methods, **p.methods})
    return tuple(merged.values())


def merge_parts(parts: List[Part]) -> Part:
    """One result from the runs on several servers: points of the same (context, rate, agents,
    rounds) joined (their ratios then cover every method), capacity rows per context joined."""
    cap: Capacity = {}
    for x in parts:
        for ctx, rows in x.capacity.items():
            cap.setdefault(ctx, {}).update(rows)
    return Part(
        points=tuple(sorted(_join([x.points for x in parts]), key=lambda p: p.key)),
        skipped=tuple(s for x in parts for s in x.skipped),
        capacity=capacity_ratios(cap),
        scaling={kind: _join([x.scaling[kind] for x in parts]) for kind in ("agents", "rounds")},
        timeline=tuple(r for x in parts for r in x.timeline),
    )


def saturation(points: Tuple[Point, ...]) -> Dict[str, Dict[str, Dict[str, Optional[float]]]]:
    """Per context and method: the highest rate measured before the first saturated one
    (``sustained``) and that first saturated rate (None: never saturated in the sweep), plus
    ``sustained`` over nonshared's."""
    out: Dict[str, Dict[str, Dict[str, Optional[float]]]] = {}
    for p in sorted(points, key=lambda p: (p.context, p.rate)):
        if p.rate <= 0:
            continue
        ctx = out.setdefault(str(p.context), {})
        for m, res in p.methods.items():
            row = ctx.setdefault(m, {"sustained": None, "first_saturated": None})
            if row["first_saturated"] is None:
                if res.saturated:
                    row["first_saturated"] = p.rate
                else:
                    row["sustained"] = p.rate
    for ctx in out.values():
        base = (ctx.get(BASELINE) or {}).get("sustained")
        for row in ctx.values():
            row["sustained_vs_nonshared"] = (row["sustained"] / base) if base and row["sustained"] else None
    return out
