"""Running one point: the workflows of one method at one rate (or closed loop), every request
streamed and timed (``benchmarks.client.stream_generate``), summarised as a ``PointResult``."""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import requests

from benchmarks.client import Generated, Percentiles, RequestFailed, stream_generate
from benchmarks.fidelity_metrics import recomputed_reuse
from benchmarks.serving.memory import MemorySampler
from benchmarks.serving.results import PointResult
from benchmarks.serving.workload import PointSpec, arrival_offsets
from sglang_kvshare.routing import routing_headers
from sglang_kvshare.testing.workflows import make_roles
from sglang_kvshare.workflows import build_payload, build_schedule, build_segments

# what the run's timeline keeps of each request
LOG_FIELDS = (
    "turn",
    "agent",
    "ttft_s",
    "reused_tokens",
    "shared_tokens",
    "accepted",
    "rejected",
    "recomputed_rows",
    "gates",
    "end",
)


def kvshare_of(meta: Dict[str, Any]) -> Dict[str, Any]:
    """``meta_info.kvshare`` of a reply ({} without one)."""
    kv = meta.get("kvshare") or {}
    if isinstance(kv, list):  # streamed chunks carry it as a one-element list
        kv = kv[0] if kv else {}
    return kv


@dataclass(frozen=True)
class Request:
    """One request of a workflow as the client saw it; a failed one has ``error`` and nothing else."""

    turn: int
    agent: str
    error: Optional[str] = None
    ttft_s: Optional[float] = None
    e2e_s: Optional[float] = None
    end: Optional[float] = None  # perf_counter at the last chunk
    prompt_tokens: Optional[int] = None
    completion_tokens: Optional[int] = None
    computed_tokens: Optional[int] = None
    reused_tokens: Optional[float] = None
    injected_tokens: Optional[int] = None
    shared_tokens: Optional[int] = None
    has_kvshare: bool = False
    accepted: int = 0
    rejected: int = 0
    recomputed_rows: int = 0
    correction_ms: Optional[float] = None
    gates: Tuple[str, ...] = ()
    kept_as: Tuple[str, ...] = ()
    anchor_bytes_per_token: Tuple[Tuple[float, int], ...] = ()  # (one anchor's bytes per token, tokens)
    kv_bytes_per_token: Optional[float] = None

    @classmethod
    def of(cls, turn: int, agent: str, res: Generated) -> "Request":
        meta, kv = res.meta, kvshare_of(res.meta)
        segs = kv.get("segments", [])
        # selective recomputation: count the reused fraction of a recomputed segment's token-layers
        partly_reused = sum(recomputed_reuse(s) for s in segs)
        return cls(
            turn,
            agent,
            ttft_s=res.ttft_s,
            e2e_s=res.e2e_s,
            end=time.perf_counter(),
            prompt_tokens=kv.get("prompt_tokens", meta.get("prompt_tokens")),
            completion_tokens=meta.get("completion_tokens"),
            computed_tokens=kv.get("computed_tokens"),
            reused_tokens=kv.get("reused_tokens", 0) + partly_reused,
            injected_tokens=kv.get("injected_tokens", 0),
            shared_tokens=sum(s["tokens"] for s in segs if s.get("shared")),
            has_kvshare=bool(kv),
            accepted=kv.get("corrections_accepted", 0),
            rejected=kv.get("corrections_rejected", 0),
            recomputed_rows=kv.get("recomputed_rows", 0),
            correction_ms=kv.get("correction_ms"),
            gates=tuple(s["gate"] for s in segs if "gate" in s),
            kept_as=tuple(s["kept_as"] for s in segs if "kept_as" in s),
            anchor_bytes_per_token=tuple(
                (s["anchor_bytes_per_token"], s["tokens"]) for s in segs if "anchor_bytes_per_token" in s
            ),
            kv_bytes_per_token=kv.get("kv_bytes_per_token"),
        )

    @property
    def fell_back(self) -> bool:
        """A rejected segment (dense fallback) or recomputed rows (partial fallback)."""
        return bool(self.rejected or self.recomputed_rows)


def run_workflow(url: str, spec: PointSpec, context: str, wf_id: str, timeout: float, on_request) -> List[Request]:
    """All turns of one workflow in order; one record per request (stops at an error)."""
    task_roles, final = make_roles(spec.agents, spec.kind, spec.prefix)
    roles = {r.name: r for r in task_roles + [final]}
    schedule = build_schedule("loop", [r.name for r in task_roles], final.name, spec.rounds)
    outputs: List[str] = []
    records: List[Request] = []
    session = requests.Session()
    for i, turn in enumerate(schedule):
        role = roles[turn.agent]
        reads = [(schedule[j].agent, roles[schedule[j].agent].title, outputs[j]) for j in turn.reads]
        payload = build_payload(role, build_segments(role, context, reads), wf_id, spec.method, spec.output_len)
        payload["sampling_params"]["ignore_eos"] = True
        try:
            # the routing-key header keeps a workflow on one worker behind launch_router (one server ignores it)
            res = stream_generate(session, url, payload, timeout, headers=routing_headers(payload))
        except (RequestFailed, requests.RequestException) as e:
            records.append(Request(i, turn.agent, error=f"{type(e).__name__}: {e}"))
            on_request()
            break
        records.append(Request.of(i, turn.agent, res))
        outputs.append(res.text)
        on_request()
    return records


def steady_throughput(ends: List[float]) -> Optional[float]:
    """Workflows per second between the first and the last completion: (n - 1) / span, free of
    the ramp-up before the first completion (None with fewer than two)."""
    ends = sorted(ends)
    return (len(ends) - 1) / (ends[-1] - ends[0]) if len(ends) > 1 and ends[-1] > ends[0] else None


def run_point(url: str, spec: PointSpec, contexts: List[str], pid: Optional[int], timeout: float, bar) -> PointResult:
    """``spec.workflows`` workflows at ``spec.rate`` (or closed-loop at ``spec.concurrency``)."""
    offsets = None if spec.concurrency else arrival_offsets(spec.rate, spec.workflows, spec.seed)
    lock = threading.Lock()

    def tick():
        with lock:
            bar.update()

    run_tag = uuid.uuid4().hex[:6]
    workflows: List[Optional[Tuple[float, List[Request]]]] = [None] * spec.workflows  # (arrival, requests)
    with MemorySampler(pid, url) as mem:
        t0 = time.perf_counter()

        def one(k: int):
            if offsets is not None:
                delay = t0 + offsets[k] - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
            start = time.perf_counter()
            wf = f"serving-{run_tag}-{spec.method}-c{spec.context}-r{spec.rate}-w{k}"
            workflows[k] = (start, run_workflow(url, spec, contexts[k], wf, timeout, tick))

        if offsets is None and not spec.concurrency:  # single stream
            for k in range(spec.workflows):
                one(k)
        else:
            with ThreadPoolExecutor(max_workers=spec.concurrency or spec.workflows) as pool:
                for f in [pool.submit(one, k) for k in range(spec.workflows)]:
                    f.result()  # each request is bounded by its timeout
    return summarise(spec, [wf for wf in workflows if wf], t0, mem)


def summarise(spec: PointSpec, workflows: List[Tuple[float, List[Request]]], t0: float, mem) -> PointResult:
    """A point's metrics from its workflows' (arrival, requests) and the memory sampler."""
    ok = [r for _, recs in workflows for r in recs if r.error is None]
    errors = [r.error for _, recs in workflows for r in recs if r.error is not None]
    ends = [r.end for r in ok]
    makespan = (max(ends) - t0) if ends else None
    done = [(arrival, recs[-1].end) for arrival, recs in workflows if recs and recs[-1].error is None]
    wf_lat = [end - arrival for arrival, end in done]
    later = [r for r in ok if r.turn > 0]

    def total(name: str, rows=ok) -> Optional[int]:
        vals = [getattr(r, name) for r in rows]
        return None if not rows or any(v is None for v in vals) else int(sum(vals))

    out_tok, prompt_tok = total("completion_tokens"), total("prompt_tokens")
    # one anchor's bytes per token, weighted by the tokens of the segments it served (a 16-token
    # output slot's anchor holds as much of B as a 2K question's, spread over 16 tokens)
    bpt = [b for r in ok for b in r.anchor_bytes_per_token]
    kv_bpt = [r.kv_bytes_per_token for r in ok if r.kv_bytes_per_token]
    shared, reused = total("shared_tokens"), total("reused_tokens")
    shared_l, reused_l = total("shared_tokens", later), total("reused_tokens", later)
    injected = total("injected_tokens")
    return PointResult(
        context=spec.context,
        rate=spec.rate,
        method=spec.method,
        agents=spec.agents,
        rounds=spec.rounds,
        workflows=spec.workflows,
        output_len=spec.output_len,
        requests=len(ok),
        errors=len(errors),
        error_messages=tuple(errors[:5]),
        kvshare_missing=sum(1 for r in ok if not r.has_kvshare),
        ttft_s=Percentiles.of(r.ttft_s for r in ok),
        ttft_later_s=Percentiles.of(r.ttft_s for r in later),
        ttft_fallback_s=Percentiles.of(r.ttft_s for r in later if r.fell_back),
        fallback_turns=sum(1 for r in later if r.fell_back),
        recomputed_rows=sum(r.recomputed_rows for r in ok),
        e2e_s=Percentiles.of(r.e2e_s for r in ok),
        workflow_latency_s=Percentiles.of(wf_lat),
        makespan_s=makespan,
        achieved_wf_per_s=(len(wf_lat) / makespan) if makespan else None,
        steady_wf_per_s=steady_throughput([end for _, end in done]),
        output_tokens=out_tok,
        prompt_tokens=prompt_tok,
        computed_tokens=total("computed_tokens"),
        reused_tokens=reused,
        shared_tokens=shared,
        output_tok_s=(out_tok / makespan) if out_tok and makespan else None,
        total_tok_s=((out_tok + prompt_tok) / makespan) if out_tok and prompt_tok and makespan else None,
        injected_tokens=injected,
        rho=(reused / shared) if shared else None,
        rho_injected=(injected / shared) if shared and injected is not None else None,
        rho_later=(reused_l / shared_l) if shared_l else None,
        corrections_accepted=sum(r.accepted for r in ok),
        corrections_rejected=sum(r.rejected for r in ok),
        gates=dict(sorted(Counter(g for r in ok for g in r.gates).items())),
        kept_as=dict(sorted(Counter(k for r in ok for k in r.kept_as).items())),
        correction_ms=Percentiles.of(r.correction_ms for r in later),
        anchor_bytes_per_token=sum(b * n for b, n in bpt) / sum(n for _, n in bpt) if bpt else None,
        kv_bytes_per_token=kv_bpt[0] if kv_bpt else None,
        rss_baseline_mb=mem.baseline,
        peak_rss_mb=mem.peak_rss,
        peak_rss_delta_mb=mem.peak_rss_delta_mb,
        peak_gpu_mb=mem.peak_gpu,
        peak_kv_tokens=mem.peak_kv_tokens,
        peak_kv_mb=mem.peak_kv_mb,
        workers_memory=mem.per_worker(),
        requests_log=tuple({name: getattr(r, name) for name in LOG_FIELDS} for r in ok),
    )
