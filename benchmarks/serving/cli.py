"""Serving benchmark: controlled multi-agent traces at rising workflow arrival rates, per method.

A *workflow* is one run of a fixed agent schedule (``sglang_kvshare.workflows.build_schedule``,
topology ``loop``): ``--base-agents`` agents (task agents ``agent0..`` then ``final``) over
``--base-rounds`` rounds; every agent reads the shared context (slot ``q``) and the latest output
of every task agent so far (slots ``out:<agent>``), laid out by ``build_segments`` (ChatML). Every
agent output has exactly ``--output-len`` tokens (``max_new_tokens`` fixed, ``ignore_eos: true``)
and is fed unchanged into later agents' inputs. Each workflow gets its own shared context of
``N`` tokens (numbered facts, unique per workflow), swept over ``--contexts``.

Arrivals: for each rate ``λ`` (workflows/s) in ``--rates``, ``--workflows`` workflows arrive as a
Poisson process (seeded: every method sees the same arrival times); a workflow's agents run in
order, workflows overlap. Rate ``0`` means single stream: workflows one after another. Rates rise
until every method is saturated (its median workflow latency exceeds ``--saturation-factor`` x
its latency at the lowest rate measured); higher rates are then skipped for that context.

Metrics per (context, rate, method), all from one run of this script:

- TTFT p50/p90/p99: every request is streamed (``"stream": true``); TTFT is the client wall time
  from sending the POST to receiving the first SSE data chunk on 127.0.0.1 (tokenisation,
  queueing, prefill/injection and the first token). ``ttft_later_s``: the same over agents after
  the first turn (those that can reuse).
- ``e2e_s``: request latency (POST to last chunk); ``workflow_latency_s``: arrival of a workflow
  to its last agent's last chunk.
- ``output_tok_s`` / ``total_tok_s``: output (resp. prompt+output) tokens of all requests divided
  by the makespan (first arrival to last completion).
- ``peak_rss_mb``: peak resident set size summed over the server's process tree (psutil, sampled
  every 0.25 s while the point runs); ``peak_rss_delta_mb`` subtracts the RSS just before it.
  ``peak_gpu_mb``: peak ``nvidia-smi`` memory.used when a GPU is present, else null (both are
  dominated by SGLang's preallocated KV pool). ``peak_kv_tokens`` / ``peak_kv_mb``: peak KV slots
  in use (SGLang's ``/v1/loads`` ``num_used_tokens``, sampled every 0.5 s) and their size.
  Through a ``launch_router`` URL these read the workers, not the router: the peaks of the sums
  over the workers (the RSS of those on this host), and ``workers_memory`` each worker's own.
- ``rho`` = reused / shared tokens summed over all requests (``meta_info.kvshare.reused_tokens``,
  which also counts ordinary prefix-cache hits in the agent's own namespace, e.g. an agent's
  second round; and the tokens of segments with ``shared: true``; a segment under selective
  recomputation adds its source-covered tokens times the fraction of their token-layers that were
  reused); ``rho_injected`` counts only
  injected (cross-agent) tokens; ``rho_later`` is ``rho`` over turns after the first.
- ``ratios``: each method's value / nonshared's value at the same point (nonshared must be among
  ``--methods``); figures show the absolute numbers with the ratio panel beneath.

Scaling sweeps (appendix style, one factor varied, the others at their base values, at rate
``--scaling-rate`` and context ``--scaling-context``): ``--agents`` (e.g. 2,4,8) and ``--rounds``
(e.g. 2,4,8).

Known limits: the server does not record output token ids of *streamed* responses, so a later
agent's ``out:<agent>`` segment is re-tokenised from text and only its common prefix with the
source's tokens can be reused (``rho`` shows how much was); ``meta_info.kvshare`` arrives as a
one-element list in streamed chunks (unwrapped here).

    python -m benchmarks.serving                       # starts a SmolLM2 server; full CPU sweep
    python -m benchmarks.serving --url http://127.0.0.1:30000 --rates 0,0.05,0.1,0.2
    python -m benchmarks.serving --quick               # a few minutes on a 2-core CPU
    python -m benchmarks.serving --agent-kind lora     # LoRA agents: the PReCache methods
    python -m benchmarks.serving --replot --out results/serving.json
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import requests
from tqdm import tqdm

from benchmarks.fidelity import adapters
from benchmarks.fidelity_metrics import recomputed_reuse
from sglang_kvshare.routing import routing_headers
from sglang_kvshare.workflows import (
    Role,
    build_payload,
    build_schedule,
    build_segments,
    lora_conversation_roles,
)

DEFAULT_METHODS = ("nonshared", "fullshared", "kvcmas")
# --agent-kind lora: the PReCache methods on an LR-cache server (rebase_shared_lp: a later agent's
# TTFT includes waiting for the rebuild the previous turn queued, if it has not finished)
LORA_METHODS = ("nonshared", "fullshared", "baseshared", "prelr_shared", "rebase_shared_db", "rebase_shared_lp")
LORA_SERVER_ARGS = ("--enable-lora", "--lora-backend", "torch_native", "--max-loras-per-batch", "4",
                    "--kvshare-lr-cache", "--lora-paths", *(f"{n}={p}" for n, p in adapters().items()))
# PReCache's FullShared baseline: a later LoRA agent reuses the previous agent's adapted K/V as they
# are, which needs K/V with the value deltas in them: a plain LoRA server (no LR cache), started
# after the LR-cache server's methods have run
PLAIN_LORA_METHODS = ("fullshared",)
LORA_KINDS = ("lora", "lora-random")


def random_adapters(model_path: str, n: int, rank: int, out_dir: Path, seed: int = 0) -> Dict[str, str]:
    """``n`` PEFT LoRA adapters ``a0..`` (q_proj, v_proj, rank ``rank``, alpha 2 x rank) with random
    weights for the model: for timing any number of agents and ranks (their outputs mean
    nothing). Returns name -> directory."""
    from sglang_kvshare.testing.tiny_model import build_tiny_adapter

    # B small enough that greedy text stays text-like
    return {f"a{i}": build_tiny_adapter(model_path, out_dir / f"a{i}", seed + i, rank=rank, b_std=0.02)
            for i in range(n)}


BASELINE = "nonshared"
FINAL = "final"
SPECIALTIES = (
    "domain expert who recalls the relevant facts",
    "analyst who reasons step by step",
    "critic who checks the other agents' claims",
    "programmer who verifies the numbers with code",
    "summariser who condenses the discussion",
    "sceptic who looks for missing cases",
    "planner who splits the task into steps",
)
PERCENTILES = (50, 90, 99)
# metrics compared against nonshared (ratio = method / nonshared)
RATIO_KEYS = (
    "ttft_s.p50", "ttft_s.p90", "ttft_s.p99", "ttft_later_s.p50", "e2e_s.p50", "workflow_latency_s.p50",
    "output_tok_s", "total_tok_s", "peak_rss_mb", "peak_rss_delta_mb", "peak_gpu_mb", "peak_kv_tokens",
    "computed_tokens",
)


# ----------------------------------------------------------------------------- workload


def make_roles(n_agents: int, kind: str = "prompt", prefix: str = "") -> tuple[List[Role], Role]:
    """``n_agents - 1`` task agents ``agent0..`` (distinct system prompts) and the final agent;
    ``kind="lora"``: the three adapter agents of ``lora_conversation_roles`` (one growing chat).
    ``prefix`` renames the prompt agents (other roles: ``<prefix>agent0``, ``<prefix>final``)."""
    if kind == "lora":
        roles = lora_conversation_roles()
        if n_agents != len(roles.roles):
            raise ValueError(f"--agent-kind lora has {len(roles.roles)} agents (the shipped adapters)")
        return list(roles.task_roles), roles.final_role
    if kind == "lora-random":  # the shipped roles' turns, in a cycle, with adapters a0, a1, ...
        shipped = lora_conversation_roles().roles
        roles = [replace(shipped[i % len(shipped)], name=f"a{i}", lora_path=f"a{i}") for i in range(n_agents)]
        return roles[:-1], roles[-1]
    if n_agents < 2:
        raise ValueError("a workflow needs at least 2 agents (one task agent and the final agent)")
    shift = 3 if prefix else 0  # other roles: other specialties too
    task = [
        Role(name=f"{prefix}agent{i}", title=f"Agent {i}",
             system_prompt=f"You are agent {i}, a {SPECIALTIES[(i + shift) % len(SPECIALTIES)]}. Answer briefly.")
        for i in range(n_agents - 1)
    ]
    final = Role(name=prefix + FINAL, title="Final", glue_template="\n\n{source} answered:\n",
                 system_prompt=("You are the moderator. Weigh the answers above." if prefix else
                                "You are the final decision-maker. Read the other agents and answer."),
                 closing_instruction="\n\nGive the final answer.")
    return task, final


_NOTES: List[str] = []


def _notes() -> List[str]:
    """Real notes: every MMLU question (with options) and GSM8K problem of the packaged data."""
    if not _NOTES:
        from benchmarks.datasets import load_tasks

        _NOTES.extend(t.question.replace("Question: ", "", 1) for t in load_tasks("mmlu") + load_tasks("gsm8k"))
    return _NOTES


def make_context(tok, n_tokens: int, tag: str) -> str:
    """A shared context of ``n_tokens`` tokens (as the server tokenises it, rarely one more), unique
    per ``tag``: numbered notes drawn from the packaged MMLU and GSM8K items (seeded by ``tag``),
    then a question about one of them."""
    import random

    notes = _notes()
    rng = random.Random(f"context:{tag}")
    head, tail = f"Case {tag}. Notes:\n", "\nQuestion: which note above is the hardest, and why?"
    budget = n_tokens - len(tok.encode(head + tail, add_special_tokens=False))
    parts, used = [], 0
    while used < budget + 16:
        note = f"{len(parts) + 1}. {notes[rng.randrange(len(notes))].strip()}\n"
        parts.append(note)
        used += len(tok.encode(note, add_special_tokens=False))
    ids = tok.encode("".join(parts), add_special_tokens=False)
    cut = max(1, budget)
    while len(tok.encode(text := head + tok.decode(ids[:cut]) + tail, add_special_tokens=False)) < n_tokens:
        cut += 1  # a token can merge across the seams: grow until the count is reached
    return text


@dataclass(frozen=True)
class PointSpec:
    context: int
    rate: float
    method: str
    agents: int
    rounds: int
    workflows: int
    output_len: int
    seed: int
    kind: str = "prompt"
    prefix: str = ""
    concurrency: int = 0  # > 0: closed loop, this many workflows in flight, no arrival times



def arrival_offsets(rate: float, n: int, seed: int) -> Optional[List[float]]:
    """Poisson arrival times (s after start; the first at 0) or None for single stream (rate 0)."""
    if rate <= 0:
        return None
    import random

    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


# ----------------------------------------------------------------------------- transport


class RequestFailed(RuntimeError):
    pass


def kvshare_of(meta: Dict[str, Any]) -> Dict[str, Any]:
    kv = meta.get("kvshare") or {}
    if isinstance(kv, list):  # streamed chunks carry it as a one-element list
        kv = kv[0] if kv else {}
    return kv


def stream_generate(session: requests.Session, url: str, payload: Dict[str, Any], timeout: float) -> Dict[str, Any]:
    """POST a streamed /generate; returns ttft_s, e2e_s, text, meta (of the last chunk)."""
    body = dict(payload, stream=True)
    t0 = time.perf_counter()
    # the routing-key header keeps a workflow on one worker behind launch_router (ignored by one server)
    with session.post(url + "/generate", json=body, stream=True, timeout=timeout,
                      headers=routing_headers(payload)) as r:
        if r.status_code != 200:
            raise RequestFailed(f"HTTP {r.status_code}: {r.text[:1000]}")
        ttft, last = None, None
        for line in r.iter_lines():
            if not line or not line.startswith(b"data:"):
                continue
            if line.strip() == b"data: [DONE]":
                break
            if ttft is None:
                ttft = time.perf_counter() - t0
            last = json.loads(line[5:])
            if time.perf_counter() - t0 > timeout:
                raise RequestFailed(f"request exceeded {timeout}s")
    e2e = time.perf_counter() - t0
    if last is None:
        raise RequestFailed("stream ended without data")
    if "error" in last:
        raise RequestFailed(str(last["error"])[:1000])
    return {"ttft_s": ttft, "e2e_s": e2e, "text": last.get("text", ""), "meta": last.get("meta_info", {})}


# ----------------------------------------------------------------------------- memory


def find_server_pid(url: str) -> Optional[int]:
    """PID listening on the URL's port on this host (None if not found / not permitted)."""
    import psutil
    from urllib.parse import urlparse

    port = urlparse(url).port
    try:
        for c in psutil.net_connections(kind="tcp"):
            if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN and c.pid:
                return c.pid
    except (psutil.AccessDenied, PermissionError):
        return None
    return None


def tree_rss_mb(pid: int) -> Optional[float]:
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root] + root.children(recursive=True)
    except psutil.NoSuchProcess:
        return None
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return total / 2**20


def gpu_used_mb() -> Optional[float]:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=5).stdout
        return float(sum(float(x) for x in out.split()))
    except (subprocess.SubprocessError, ValueError):
        return None


def kv_load(session: requests.Session, url: str) -> Optional[Dict[str, float]]:
    """KV slots in use from SGLang's ``/v1/loads`` (summed over DP ranks), with MB per token."""
    try:
        loads = session.get(url + "/v1/loads", timeout=5).json()["loads"]
        used = sum(float(x.get("num_used_tokens") or 0) for x in loads)
        cap = sum(float((x.get("memory") or {}).get("token_capacity") or x.get("max_total_num_tokens") or 0) for x in loads)
        gb = sum(float((x.get("memory") or {}).get("kv_cache_gb") or 0) for x in loads)
        return {"used_tokens": used, "mb_per_token": (gb * 1024 / cap) if cap and gb else None}
    except (requests.RequestException, ValueError, KeyError, TypeError):
        return None


def router_worker_urls(url: str) -> List[str]:
    """The workers behind ``url`` when it is a ``launch_router`` URL (the router's ``GET
    /workers``), else [] (one server: SGLang has no such route)."""
    from sglang_kvshare.launch_router import router_workers

    return [w["url"] for w in router_workers(url) or [] if w.get("url")]


def _total(values: List[Optional[float]]) -> Optional[float]:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def _peak(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return b if a is None else a if b is None else max(a, b)


class MemorySampler:
    """Samples, in a thread until the ``with`` block ends: the server tree's RSS (every
    ``interval`` s), GPU memory (nvidia-smi, every 1 s) and KV slots in use (``/v1/loads``,
    every 0.5 s). Behind a router (``launch_router``) it reads each worker instead of the router:
    its process tree (found by its port, so only workers on this host) and its ``/v1/loads``; the
    totals are the peaks of the per-sample sums, ``per_worker()`` each worker's own readings."""

    def __init__(self, pid: Optional[int], url: Optional[str] = None, interval: float = 0.25):
        self.pid, self.url, self.interval = pid, url, interval
        self.worker_urls = router_worker_urls(url) if url else []
        self.targets = [(find_server_pid(w), w) for w in self.worker_urls] or [(pid, url)]
        self.baselines = [tree_rss_mb(p) if p else None for p, _ in self.targets]
        self.peaks_rss = list(self.baselines)
        self.baseline = self.peak_rss = _total(self.baselines)
        self.gpu = shutil.which("nvidia-smi") is not None
        self.peak_gpu = gpu_used_mb() if self.gpu else None
        self._session = requests.Session()
        first = [kv_load(self._session, u) if u else None for _, u in self.targets]
        self.peaks_kv = [f["used_tokens"] if f else None for f in first]  # None: not sampled
        self.peak_kv_tokens = _total(self.peaks_kv)
        self.kv_mb_per_token = next((f["mb_per_token"] for f in first if f), None)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        last_gpu = last_kv = 0.0
        while not self._stop.wait(self.interval):
            rss = [tree_rss_mb(p) if p else None for p, _ in self.targets]
            self.peaks_rss = [_peak(a, b) for a, b in zip(self.peaks_rss, rss)]
            total = _total(rss)
            if total is not None:
                self.peak_rss = max(self.peak_rss or 0.0, total)
            now = time.time()
            if self.gpu and now - last_gpu >= 1.0:
                last_gpu = now
                g = gpu_used_mb()
                if g is not None:
                    self.peak_gpu = max(self.peak_gpu or 0.0, g)
            if self.peak_kv_tokens is not None and now - last_kv >= 0.5:
                last_kv = now
                kv = [kv_load(self._session, u) if peak is not None else None
                      for peak, (_, u) in zip(self.peaks_kv, self.targets)]
                used = [k["used_tokens"] if k else None for k in kv]
                self.peaks_kv = [_peak(a, b) for a, b in zip(self.peaks_kv, used)]
                total = _total(used)
                if total is not None:
                    self.peak_kv_tokens = max(self.peak_kv_tokens, total)

    @property
    def peak_kv_mb(self) -> Optional[float]:
        if self.peak_kv_tokens is None or self.kv_mb_per_token is None:
            return None
        return self.peak_kv_tokens * self.kv_mb_per_token

    def per_worker(self) -> Optional[Dict[str, Dict[str, Optional[float]]]]:
        """{worker URL: its RSS baseline and peak (MB), peak KV slots in use}; None for one server."""
        if not self.worker_urls:
            return None
        return {u: {"rss_baseline_mb": b, "peak_rss_mb": r, "peak_kv_tokens": k}
                for (_, u), b, r, k in zip(self.targets, self.baselines, self.peaks_rss, self.peaks_kv)}

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=10)


# ----------------------------------------------------------------------------- one point


def run_workflow(url: str, spec: PointSpec, context: str, wf_id: str, timeout: float, on_request) -> List[Dict[str, Any]]:
    """All turns of one workflow in order; returns one record per request (stops at an error)."""
    task_roles, final = make_roles(spec.agents, spec.kind, spec.prefix)
    roles = {r.name: r for r in task_roles + [final]}
    schedule = build_schedule("loop", [r.name for r in task_roles], final.name, spec.rounds)
    outputs: List[str] = []
    records: List[Dict[str, Any]] = []
    session = requests.Session()
    for i, turn in enumerate(schedule):
        role = roles[turn.agent]
        reads = [(schedule[j].agent, roles[schedule[j].agent].title, outputs[j]) for j in turn.reads]
        segments = build_segments(role, context, reads)
        payload = build_payload(role, segments, wf_id, spec.method, spec.output_len)
        payload["sampling_params"]["ignore_eos"] = True
        rec: Dict[str, Any] = {"turn": i, "agent": turn.agent}
        try:
            res = stream_generate(session, url, payload, timeout)
        except (RequestFailed, requests.RequestException) as e:
            rec["error"] = f"{type(e).__name__}: {e}"
            records.append(rec)
            on_request()
            break
        meta, kv = res["meta"], kvshare_of(res["meta"])
        segs = kv.get("segments", [])
        shared_tok = sum(s["tokens"] for s in segs if s.get("shared"))
        # selective recomputation: count the reused fraction of a recomputed segment's token-layers
        partly_reused = sum(recomputed_reuse(s) for s in kv.get("segments", []))
        rec.update(
            ttft_s=res["ttft_s"], e2e_s=res["e2e_s"], end=time.perf_counter(),
            prompt_tokens=kv.get("prompt_tokens", meta.get("prompt_tokens")),
            completion_tokens=meta.get("completion_tokens"),
            computed_tokens=kv.get("computed_tokens"), reused_tokens=kv.get("reused_tokens", 0) + partly_reused,
            injected_tokens=kv.get("injected_tokens", 0),
            shared_tokens=shared_tok, has_kvshare=bool(kv),
            accepted=kv.get("corrections_accepted", 0), rejected=kv.get("corrections_rejected", 0),
            recomputed_rows=kv.get("recomputed_rows", 0),
            correction_ms=kv.get("correction_ms"),
            gates=[s["gate"] for s in segs if "gate" in s],
            kept_as=[s["kept_as"] for s in segs if "kept_as" in s],
            anchor_bytes_per_token=[(s["anchor_bytes_per_token"], s["tokens"]) for s in segs
                                    if "anchor_bytes_per_token" in s],
            kv_bytes_per_token=kv.get("kv_bytes_per_token"),
        )
        records.append(rec)
        outputs.append(res["text"])
        on_request()
    return records


def pct(values: Sequence[float]) -> Optional[Dict[str, float]]:
    vals = sorted(v for v in values if v is not None)
    if not vals:
        return None

    def q(p):  # linear interpolation between closest ranks
        k = (len(vals) - 1) * p / 100
        lo, hi = math.floor(k), math.ceil(k)
        return vals[lo] + (vals[hi] - vals[lo]) * (k - lo)

    return {**{f"p{p}": q(p) for p in PERCENTILES}, "mean": statistics.fmean(vals), "n": len(vals)}


def run_point(url: str, spec: PointSpec, contexts: List[str], pid: Optional[int], timeout: float, bar) -> Dict[str, Any]:
    """``spec.workflows`` workflows at ``spec.rate`` (or closed-loop at ``spec.concurrency``);
    returns the point's metrics."""
    offsets = None if spec.concurrency else arrival_offsets(spec.rate, spec.workflows, spec.seed)
    lock = threading.Lock()

    def tick():
        with lock:
            bar.update()

    run_tag = uuid.uuid4().hex[:6]
    results: List[Optional[Dict[str, Any]]] = [None] * spec.workflows
    with MemorySampler(pid, url) as mem:
        t0 = time.perf_counter()

        def one(k: int):
            if offsets is not None:
                delay = t0 + offsets[k] - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
            start = time.perf_counter()
            wf = f"serving-{run_tag}-{spec.method}-c{spec.context}-r{spec.rate}-w{k}"
            recs = run_workflow(url, spec, contexts[k], wf, timeout, tick)
            results[k] = {"arrival": start, "records": recs}

        if offsets is None and not spec.concurrency:  # single stream
            for k in range(spec.workflows):
                one(k)
        else:
            with ThreadPoolExecutor(max_workers=spec.concurrency or spec.workflows) as pool:
                futures = [pool.submit(one, k) for k in range(spec.workflows)]
                for f in futures:
                    f.result()  # each request is bounded by its timeout
    recs = [r for wf in results if wf for r in wf["records"]]
    ok = [r for r in recs if "error" not in r]
    errors = [r["error"] for r in recs if "error" in r]
    ends = [r["end"] for r in ok]
    makespan = (max(ends) - t0) if ends else None
    wf_lat = [wf["records"][-1]["end"] - wf["arrival"] for wf in results
              if wf and wf["records"] and "error" not in wf["records"][-1]]
    later = [r for r in ok if r["turn"] > 0]

    def total(key, rows=ok):
        vals = [r.get(key) for r in rows]
        return None if not rows or any(v is None for v in vals) else int(sum(vals))

    out_tok, prompt_tok = total("completion_tokens"), total("prompt_tokens")
    # one anchor's bytes per token, weighted by the tokens of the segments it served (a 16-token
    # output slot's anchor holds as much of B as a 2K question's, spread over 16 tokens)
    bpt = [tuple(b) for r in ok for b in r.get("anchor_bytes_per_token", [])]
    kv_bpt = [r["kv_bytes_per_token"] for r in ok if r.get("kv_bytes_per_token")]
    shared, reused = total("shared_tokens"), total("reused_tokens")
    shared_l, reused_l = total("shared_tokens", later), total("reused_tokens", later)
    injected = total("injected_tokens")
    return {
        "context": spec.context, "rate": spec.rate, "method": spec.method, "agents": spec.agents,
        "rounds": spec.rounds, "workflows": spec.workflows, "output_len": spec.output_len,
        "requests": len(ok), "errors": len(errors), "error_messages": errors[:5],
        "kvshare_missing": sum(1 for r in ok if not r["has_kvshare"]),
        "ttft_s": pct([r["ttft_s"] for r in ok]),
        "ttft_later_s": pct([r["ttft_s"] for r in later]),
        # later turns with a fallback: a rejected segment (dense) or recomputed rows (partial)
        "ttft_fallback_s": pct([r["ttft_s"] for r in later if r.get("rejected") or r.get("recomputed_rows")]),
        "fallback_turns": sum(1 for r in later if r.get("rejected") or r.get("recomputed_rows")),
        "recomputed_rows": sum(r.get("recomputed_rows", 0) for r in ok),
        "e2e_s": pct([r["e2e_s"] for r in ok]),
        "workflow_latency_s": pct(wf_lat),
        "makespan_s": makespan,
        "achieved_wf_per_s": (len(wf_lat) / makespan) if makespan else None,
        "steady_wf_per_s": steady_throughput([wf["records"][-1]["end"] for wf in results
                                              if wf and wf["records"] and "error" not in wf["records"][-1]]),
        "output_tokens": out_tok, "prompt_tokens": prompt_tok,
        "computed_tokens": total("computed_tokens"), "reused_tokens": reused, "shared_tokens": shared,
        "output_tok_s": (out_tok / makespan) if out_tok and makespan else None,
        "total_tok_s": ((out_tok + prompt_tok) / makespan) if out_tok and prompt_tok and makespan else None,
        "injected_tokens": injected,
        "rho": (reused / shared) if shared else None,
        "rho_injected": (injected / shared) if shared and injected is not None else None,
        "rho_later": (reused_l / shared_l) if shared_l else None,
        "corrections_accepted": sum(r.get("accepted", 0) for r in ok),
        "corrections_rejected": sum(r.get("rejected", 0) for r in ok),
        "gates": dict(sorted(Counter(g for r in ok for g in r.get("gates", [])).items())),
        # accepted corrections kept as a KV leaf or a copy (``--kvshare-leaf-policy``)
        "kept_as": dict(sorted(Counter(k for r in ok for k in r.get("kept_as", [])).items())),
        "correction_ms": pct([r["correction_ms"] for r in later if r.get("correction_ms") is not None]),
        "anchor_bytes_per_token": sum(b * n for b, n in bpt) / sum(n for _, n in bpt) if bpt else None,
        "kv_bytes_per_token": kv_bpt[0] if kv_bpt else None,
        "requests_log": [{k: r.get(k) for k in ("turn", "agent", "ttft_s", "reused_tokens", "shared_tokens",
                                                 "accepted", "rejected", "recomputed_rows", "gates", "end")} for r in ok],
        "rss_baseline_mb": mem.baseline, "peak_rss_mb": mem.peak_rss,
        "peak_rss_delta_mb": (mem.peak_rss - mem.baseline) if mem.baseline is not None else None,
        "peak_gpu_mb": mem.peak_gpu,
        "peak_kv_tokens": mem.peak_kv_tokens, "peak_kv_mb": mem.peak_kv_mb,
        "workers_memory": mem.per_worker(),
    }


def steady_throughput(ends: List[float]) -> Optional[float]:
    """Workflows per second between the first and the last completion: (n - 1) / span, free of
    the ramp-up before the first completion (None with fewer than two)."""
    ends = sorted(ends)
    return (len(ends) - 1) / (ends[-1] - ends[0]) if len(ends) > 1 and ends[-1] > ends[0] else None


def get_path(d: Dict[str, Any], dotted: str):
    for part in dotted.split("."):
        if not isinstance(d, dict) or d.get(part) is None:
            return None
        d = d[part]
    return d


def ratios(by_method: Dict[str, Dict[str, Any]]) -> Dict[str, Dict[str, Optional[float]]]:
    """method -> {metric: method / nonshared} for RATIO_KEYS (None where undefined)."""
    base = by_method.get(BASELINE)
    if base is None:
        return {}
    out = {}
    for m, res in by_method.items():
        row = {}
        for key in RATIO_KEYS:
            a, b = get_path(res, key), get_path(base, key)
            row[key] = (a / b) if a is not None and b not in (None, 0) else None
        out[m] = row
    return out


# ----------------------------------------------------------------------------- sweeps


class Runner:
    """Runs the points of one server; every workflow gets a context of its own (no context is
    seen twice by the server), and each correction method's anchor pools are warmed up with
    ``--warmup-workflows`` workflows of the same shape before its first measured point of a
    context length. ``timeline`` keeps every request (warm-up and pre-serve included)."""

    def __init__(self, args, url: str, tok, pid: Optional[int], bar):
        self.args, self.url, self.tok, self.pid, self.bar = args, url, tok, pid, bar
        self._contexts: Dict[tuple, List[str]] = {}
        self._warm: set = set()
        self.timeline: List[Dict[str, Any]] = []

    def contexts(self, n_tokens: int, n: int, tag: str) -> List[str]:
        key = (n_tokens, n, tag)
        if key not in self._contexts:
            self._contexts[key] = [make_context(self.tok, n_tokens, f"{n_tokens}-{tag}-{k}") for k in range(n)]
        return self._contexts[key]

    def _log(self, phase: str, res: Dict[str, Any]) -> None:
        for r in res.pop("requests_log"):
            self.timeline.append({"phase": phase, "context": res["context"], "rate": res["rate"],
                                  "method": res["method"], **r})

    def run(self, spec: PointSpec, tag: str, phase: str, timeout=None) -> Dict[str, Any]:
        res = run_point(self.url, spec, self.contexts(spec.context, spec.workflows, tag),
                        self.pid if phase == "measured" else None, timeout or self.args.request_timeout, self.bar)
        self._log(phase, res)
        return res

    def warm_up(self, context: int, method: str, agents: int, rounds: int) -> None:
        """``--warmup-workflows`` single-stream workflows, not recorded (correction methods)."""
        from sglang_kvshare.methods import get_method, method_variant

        n = self.args.warmup_workflows
        correcting = get_method(method_variant(method)[0]).corrector is not None
        if n <= 0 or (context, method) in self._warm or not (correcting or self.args.server_per_method):
            return
        self._warm.add((context, method))
        self.bar.set_description(f"warm-up ctx {context} {method} ({n} workflows)")
        spec = PointSpec(context, 0.0, method, agents, rounds, n, self.args.output_len, 0, self.args.agent_kind)
        self.run(spec, "warmup", "warmup")

    def pre_serve(self) -> None:
        """``--pre-serve`` workflows of other roles, short contexts and other correction methods
        first: the server the user meets has been up for a while."""
        n = self.args.pre_serve
        methods = ("kvcmas", "kvcmas_plus", "kvcomm", "graphflow")
        for k in range(n):
            self.bar.set_description(f"pre-serve {k + 1}/{n}")
            spec = PointSpec(300 + 100 * (k % 2), 0.0, methods[k % len(methods)], 3, 1, 1, self.args.output_len, k,
                             self.args.agent_kind, prefix="other_")
            self.run(spec, f"pre{k}", "pre-serve")

    def point(self, context: int, rate: float, agents: int, rounds: int, workflows: int, seed: int) -> Dict[str, Any]:
        by_method = {}
        for method in self.args.methods:
            self.warm_up(context, method, agents, rounds)
            spec = PointSpec(context, rate, method, agents, rounds, workflows, self.args.output_len, seed,
                             self.args.agent_kind)
            self.bar.set_description(f"ctx {context} rate {rate} a{agents} r{rounds} {method}")
            by_method[method] = self.run(spec, f"r{rate}-a{agents}-r{rounds}", "measured")
        return {"context": context, "rate": rate, "agents": agents, "rounds": rounds,
                "methods": by_method, "ratios": ratios(by_method)}


def qps_sweep(runner: Runner, args) -> tuple[List[Dict[str, Any]], List[Dict[str, Any]]]:
    points, skipped = [], []
    for ci, context in enumerate(args.contexts):
        baseline_lat: Dict[str, float] = {}
        for ri, rate in enumerate(args.rates):
            p = runner.point(context, rate, args.base_agents, args.base_rounds, args.workflows, args.seed + 1000 * ci + ri)
            all_sat = True
            for m, res in p["methods"].items():
                lat = get_path(res, "workflow_latency_s.p50")
                if m not in baseline_lat and lat is not None:
                    baseline_lat[m] = lat
                sat = (rate > 0 and lat is not None and m in baseline_lat and ri > 0
                       and lat > args.saturation_factor * baseline_lat[m]) or res["errors"] > 0
                res["saturated"] = bool(sat)
                all_sat = all_sat and sat
            points.append(p)
            if all_sat and ri + 1 < len(args.rates):
                skipped += [{"context": context, "rate": r, "reason": f"all methods saturated at {rate}"}
                            for r in args.rates[ri + 1:]]
                break
    return points, skipped


def saturation(points: List[Dict[str, Any]]) -> Dict[str, Dict[str, Dict[str, Optional[float]]]]:
    """Per context and method: the highest rate measured before the first saturated one
    (``sustained``) and that first saturated rate (None: never saturated in the sweep), plus
    ``sustained`` over nonshared's."""
    out: Dict[str, Dict[str, Dict[str, Optional[float]]]] = {}
    for p in sorted(points, key=lambda p: (p["context"], p["rate"])):
        if p["rate"] <= 0:
            continue
        ctx = out.setdefault(str(p["context"]), {})
        for m, res in p["methods"].items():
            row = ctx.setdefault(m, {"sustained": None, "first_saturated": None})
            if row["first_saturated"] is None:
                if res.get("saturated"):
                    row["first_saturated"] = p["rate"]
                else:
                    row["sustained"] = p["rate"]
    for ctx in out.values():
        base = (ctx.get(BASELINE) or {}).get("sustained")
        for row in ctx.values():
            row["sustained_vs_nonshared"] = (row["sustained"] / base) if base and row["sustained"] else None
    return out


def capacity(runner: Runner, args) -> Dict[str, Dict[str, Dict[str, Optional[float]]]]:
    """Closed loop (``--capacity C``): per context and method, ``--workflows`` workflows with C in
    flight (a new one starts when one ends), after the method's warm-up. The completion rate is
    the arrival rate the server can sustain: its saturation rate. Per method: ``wf_per_s``
    (steady window), ``vs_nonshared``, the later agents' TTFT p50 and rho."""
    out: Dict[str, Dict[str, Dict[str, Optional[float]]]] = {}
    for context in args.contexts:
        rows = out.setdefault(str(context), {})
        for method in args.methods:
            runner.warm_up(context, method, args.base_agents, args.base_rounds)
            spec = PointSpec(context, 0.0, method, args.base_agents, args.base_rounds, args.workflows,
                             args.output_len, args.seed, args.agent_kind, concurrency=args.capacity)
            runner.bar.set_description(f"capacity ctx {context} C={args.capacity} {method}")
            res = runner.run(spec, f"cap{args.capacity}", "capacity")
            rows[method] = {"wf_per_s": res["steady_wf_per_s"], "wf_per_s_makespan": res["achieved_wf_per_s"],
                            "ttft_later_p50_s": get_path(res, "ttft_later_s.p50"), "rho_later": res["rho_later"],
                            "ttft_later_p90_s": get_path(res, "ttft_later_s.p90"),
                            "ttft_fallback_p90_s": get_path(res, "ttft_fallback_s.p90"),
                            "fallback_turns": res["fallback_turns"], "recomputed_rows": res["recomputed_rows"],
                            "correction_ms_p50": get_path(res, "correction_ms.p50"), "gates": res["gates"],
                            "kept_as": res["kept_as"],
                            "workflow_latency_p50_s": get_path(res, "workflow_latency_s.p50"),
                            "errors": res["errors"]}
    return capacity_ratios(out)


def capacity_ratios(cap: Dict[str, Dict[str, Dict[str, Optional[float]]]]):
    """Sets each capacity row's ``vs_nonshared`` (its wf/s over nonshared's at that context)."""
    for rows in cap.values():
        base = (rows.get(BASELINE) or {}).get("wf_per_s")
        for row in rows.values():
            row["vs_nonshared"] = (row["wf_per_s"] / base) if base and row["wf_per_s"] else None
    return cap


def scaling_sweeps(runner: Runner, args) -> Dict[str, List[Dict[str, Any]]]:
    out: Dict[str, List[Dict[str, Any]]] = {"agents": [], "rounds": []}
    for n in args.agents:
        out["agents"].append(runner.point(args.scaling_context, args.scaling_rate, n, args.base_rounds,
                                          args.scaling_workflows, args.seed + 7))
    for r in args.rounds:
        out["rounds"].append(runner.point(args.scaling_context, args.scaling_rate, args.base_agents, r,
                                          args.scaling_workflows, args.seed + 7))
    return out


class _NullBar:
    def update(self, n: int = 1) -> None:
        pass


def turns_of(agents: int, rounds: int) -> int:
    return (agents - 1) * rounds + 1


# ----------------------------------------------------------------------------- report


def _fmt(v, spec=".3f"):
    return "-" if v is None else format(v, spec)


def markdown(results: Dict[str, Any]) -> str:
    lines = ["| ctx | rate wf/s | method | TTFT p50 s | p90 | p99 | ratio p50 | e2e p50 s | wf lat p50 s "
             "| out tok/s | ratio | peak RSS MB | ratio | peak KV tok | ratio | rho | sat |",
             "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for p in results["qps_sweep"]:
        for m, r in p["methods"].items():
            ra = p["ratios"].get(m, {})
            t = r["ttft_s"] or {}
            lines.append(
                f"| {p['context']} | {p['rate']:g} | {m} | {_fmt(t.get('p50'))} | {_fmt(t.get('p90'))} | "
                f"{_fmt(t.get('p99'))} | {_fmt(ra.get('ttft_s.p50'), '.2f')} | {_fmt(get_path(r, 'e2e_s.p50'))} | "
                f"{_fmt(get_path(r, 'workflow_latency_s.p50'), '.2f')} | {_fmt(r['output_tok_s'], '.1f')} | "
                f"{_fmt(ra.get('output_tok_s'), '.2f')} | {_fmt(r['peak_rss_mb'], '.0f')} | "
                f"{_fmt(ra.get('peak_rss_mb'), '.3f')} | {_fmt(r['peak_kv_tokens'], '.0f')} | "
                f"{_fmt(ra.get('peak_kv_tokens'), '.2f')} | {_fmt(r['rho'], '.2f')} | {'yes' if r.get('saturated') else ''} |"
            )
    lines += ["", "later agents (turns after the first): TTFT p50 as a ratio to nonshared and to fullshared; "
              "rho_later = reused / shared tokens of those turns; corrections accepted / gated; correction "
              "ms p50; anchor bytes per token (one anchor, weighted by the tokens it served) vs KV bytes per token:", "",
              "| ctx | rate | method | later TTFT p50 s | vs nonshared | vs fullshared | later p90 s | fallback turns "
              "| their p90 s | rho_later | accepted | corr ms p50 | anchor B/tok | KV B/tok |",
              "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for p in results["qps_sweep"]:
        base = {m: get_path(r, "ttft_later_s.p50") for m, r in p["methods"].items()}
        for m, r in p["methods"].items():
            t = base[m]
            vs = lambda other: (t / base[other]) if t is not None and base.get(other) else None  # noqa: E731
            gated = r.get("corrections_accepted", 0) + r.get("corrections_rejected", 0)
            lines.append(
                f"| {p['context']} | {p['rate']:g} | {m} | {_fmt(t)} | {_fmt(vs('nonshared'), '.2f')} | "
                f"{_fmt(vs('fullshared'), '.2f')} | {_fmt(get_path(r, 'ttft_later_s.p90'))} | "
                f"{r.get('fallback_turns', '')} | {_fmt(get_path(r, 'ttft_fallback_s.p90'))} | {_fmt(r.get('rho_later'), '.2f')} | "
                f"{r.get('corrections_accepted', 0)}/{gated} | {_fmt(get_path(r, 'correction_ms.p50'), '.0f')} | "
                f"{_fmt(r.get('anchor_bytes_per_token'), '.0f')} | {_fmt(r.get('kv_bytes_per_token'), '.0f')} |"
            )
    sat = results.get("saturation") or {}
    if sat:
        lines += ["", "saturation (highest rate sustained before the first saturated one; wf/s):", "",
                  "| ctx | method | sustained | first saturated | sustained vs nonshared |", "|---:|---|---:|---:|---:|"]
        for ctx, rows in sat.items():
            for m, row in rows.items():
                lines.append(f"| {ctx} | {m} | {_fmt(row['sustained'], 'g')} | {_fmt(row['first_saturated'], 'g')} | "
                             f"{_fmt(row['sustained_vs_nonshared'], '.2f')} |")
    cap = results.get("capacity") or {}
    if cap:
        lines += ["", f"capacity (closed loop, {results['config'].get('capacity')} workflows in flight; completions "
                  "per second between the first and the last = the sustainable arrival rate):", "",
                  "| ctx | method | wf/s | vs nonshared | vs fullshared | later TTFT p50 s | p90 s | fallback turns "
                  "| their p90 s | recomputed rows | wf latency p50 s | rho_later |",
                  "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for ctx, rows in cap.items():
            full = (rows.get("fullshared") or {}).get("wf_per_s")
            for m, row in rows.items():
                vs_full = row["wf_per_s"] / full if full and row["wf_per_s"] else None
                lines.append(f"| {ctx} | {m} | {_fmt(row['wf_per_s'], '.4f')} | {_fmt(row['vs_nonshared'], '.2f')} | "
                             f"{_fmt(vs_full, '.2f')} | {_fmt(row['ttft_later_p50_s'], '.2f')} | "
                             f"{_fmt(row.get('ttft_later_p90_s'), '.2f')} | {row.get('fallback_turns', '')} | "
                             f"{_fmt(row.get('ttft_fallback_p90_s'), '.2f')} | {row.get('recomputed_rows', '')} | "
                             f"{_fmt(row['workflow_latency_p50_s'], '.1f')} | {_fmt(row['rho_later'], '.2f')} |")
    for kind, pts in results.get("scaling", {}).items():
        if not pts:
            continue
        lines += ["", f"scaling by {kind} (ctx {pts[0]['context']}, rate {pts[0]['rate']:g}):", "",
                  f"| {kind} | turns | method | TTFT p50 s | ratio | wf lat p50 s | ratio | rho |", "|---:|---:|---|---:|---:|---:|---:|---:|"]
        for p in pts:
            for m, r in p["methods"].items():
                ra = p["ratios"].get(m, {})
                lines.append(
                    f"| {p[kind]} | {turns_of(p['agents'], p['rounds'])} | {m} | {_fmt(get_path(r, 'ttft_s.p50'))} | "
                    f"{_fmt(ra.get('ttft_s.p50'), '.2f')} | {_fmt(get_path(r, 'workflow_latency_s.p50'), '.2f')} | "
                    f"{_fmt(ra.get('workflow_latency_s.p50'), '.2f')} | {_fmt(r['rho'], '.2f')} |"
                )
    if results.get("skipped"):
        lines.append(f"\nskipped (saturation): {results['skipped']}")
    return "\n".join(lines)


def _series(points, method, key, x_of):
    xs, ys = [], []
    for p in points:
        v = get_path(p["methods"].get(method, {}), key)
        if v is not None:
            xs.append(x_of(p))
            ys.append(v)
    return xs, ys


def _ratio_series(points, method, key, x_of):
    xs, ys = [], []
    for p in points:
        v = p["ratios"].get(method, {}).get(key)
        if v is not None:
            xs.append(x_of(p))
            ys.append(v)
    return xs, ys


def _panel_pair(ax_abs, ax_ratio, points, methods, key, x_of, ylabel, annotate=True):
    for i, m in enumerate(methods):
        xs, ys = _series(points, m, key, x_of)
        ax_abs.plot(xs, ys, "o-", color=f"C{i}", label=m)
        rx, ry = _ratio_series(points, m, key, x_of)
        ax_ratio.plot(rx, ry, "o-", color=f"C{i}", label=m)
        if annotate and m != BASELINE:
            for x, y in zip(rx, ry):
                ax_ratio.annotate(f"{y:.2f}", (x, y), xytext=(0, 4), textcoords="offset points", ha="center", fontsize=7)
    ax_abs.set_ylabel(ylabel)
    ax_ratio.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax_ratio.set_ylabel(f"ratio vs {BASELINE}")


def plot(results: Dict[str, Any], out: Path) -> List[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = results["config"]["methods"]
    paths = []
    qps = results["qps_sweep"]
    title = f"{Path(str(results['servers'][0].get('model_path'))).name}, {results['host']['machine']}"
    if qps:
        ctxs = sorted({p["context"] for p in qps})
        fig, axes = plt.subplots(2, len(ctxs), figsize=(4.2 * len(ctxs), 6.5), squeeze=False, sharex="col")
        for j, c in enumerate(ctxs):
            pts = [p for p in qps if p["context"] == c]
            _panel_pair(axes[0][j], axes[1][j], pts, methods, "ttft_s.p50", lambda p: p["rate"], "TTFT p50, s")
            for i, m in enumerate(methods):  # p90 dashed
                xs, ys = _series(pts, m, "ttft_s.p90", lambda p: p["rate"])
                axes[0][j].plot(xs, ys, "--", color=f"C{i}", alpha=0.5)
            axes[0][j].set_title(f"shared context {c} tokens")
            axes[1][j].set_xlabel("workflow arrival rate, wf/s (0 = single stream)")
        axes[0][0].legend(fontsize=8, title="solid p50, dashed p90", title_fontsize=7)
        fig.suptitle(f"TTFT vs request rate ({title})")
        fig.tight_layout()
        p = out.with_name(out.stem + "_ttft_vs_qps.png")
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)

        # memory vs context: the highest peak over the rates of each context
        mem_pts = []
        for c in ctxs:
            by_m = {}
            for m in methods:
                vals = [p["methods"][m] for p in qps if p["context"] == c and m in p["methods"]]
                if vals:  # per metric, the highest value over the rates
                    by_m[m] = {k: max((v[k] for v in vals if v.get(k) is not None), default=None)
                               for k in ("peak_rss_mb", "peak_rss_delta_mb", "peak_gpu_mb", "peak_kv_tokens")}
            mem_pts.append({"context": c, "methods": by_m, "ratios": ratios(by_m)})
        keys = [("peak_rss_mb", "peak RSS of server tree, MB"), ("peak_rss_delta_mb", "RSS growth during run, MB"),
                ("peak_kv_tokens", "peak KV slots in use, tokens")]
        if any(get_path(r, "peak_gpu_mb") for p in mem_pts for r in p["methods"].values()):
            keys.append(("peak_gpu_mb", "peak GPU memory, MB"))
        fig, axes = plt.subplots(2, len(keys), figsize=(4.5 * len(keys), 6.5), squeeze=False, sharex="col")
        for j, (key, label) in enumerate(keys):
            _panel_pair(axes[0][j], axes[1][j], mem_pts, methods, key, lambda p: p["context"], label)
            axes[1][j].set_xlabel("shared context, tokens")
        axes[0][0].legend(fontsize=8)
        for ax in axes.flat:
            ax.ticklabel_format(axis="y", useOffset=False, style="plain")
        fig.suptitle(f"Peak memory vs context (max over rates; {title})")
        fig.tight_layout()
        p = out.with_name(out.stem + "_memory_vs_context.png")
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)

    timeline = [r for r in results.get("timeline", []) if r.get("turn", 0) > 0]
    if timeline:
        p = out.with_name(out.stem + "_acceptance.png")
        plot_timeline(timeline, p, title)
        paths.append(p)

    sc = {k: v for k, v in results.get("scaling", {}).items() if v}
    if sc:
        fig, axes = plt.subplots(2, 2 * len(sc), figsize=(4.2 * 2 * len(sc), 6.5), squeeze=False, sharex="col")
        for j, (kind, pts) in enumerate(sc.items()):
            for k, (key, label) in enumerate((("ttft_s.p50", "TTFT p50, s"), ("workflow_latency_s.p50", "workflow latency p50, s"))):
                col = 2 * j + k
                _panel_pair(axes[0][col], axes[1][col], pts, methods, key, lambda p, kind=kind: p[kind], label)
                axes[0][col].set_title(f"vary {kind}")
                axes[1][col].set_xlabel(kind)
        axes[0][0].legend(fontsize=8)
        fig.suptitle(f"Scaling (ctx {results['config']['scaling_context']}, rate {results['config']['scaling_rate']:g}; {title})")
        fig.tight_layout()
        p = out.with_name(out.stem + "_scaling.png")
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)
    return paths


def plot_timeline(timeline: List[Dict[str, Any]], path: Path, title: str, window: int = 10) -> None:
    """Per correction method: the share of gated corrections accepted and rho (reused / shared
    tokens) of the later agents, as a moving average over ``window`` requests in the order they
    ran (warm-up, pre-serve and measured requests alike; phases shaded)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = [m for m in dict.fromkeys(r["method"] for r in timeline)
               if any(r.get("accepted") or r.get("rejected") for r in timeline if r["method"] == m)]
    if not methods:
        methods = list(dict.fromkeys(r["method"] for r in timeline))
    fig, axes = plt.subplots(len(methods), 1, figsize=(9, 2.6 * len(methods)), squeeze=False)
    for ax, m in zip(axes[:, 0], methods):
        rows = [r for r in timeline if r["method"] == m]
        xs = list(range(len(rows)))

        def moving(vals):
            return [statistics.fmean(vals[max(0, i - window + 1): i + 1]) for i in range(len(vals))]

        acc = [(r.get("accepted") or 0) / max(1, (r.get("accepted") or 0) + (r.get("rejected") or 0)) for r in rows]
        rho = [(r.get("reused_tokens") or 0) / max(1, r.get("shared_tokens") or 0) for r in rows]
        ax.plot(xs, moving(acc), label="accepted / gated")
        ax.plot(xs, moving(rho), label="rho (later agents)")
        for i, r in enumerate(rows):
            if r["phase"] != "measured":
                ax.axvspan(i - 0.5, i + 0.5, color="0.9", lw=0)
        ax.set_ylim(-0.05, 1.05)
        ax.set_ylabel(m)
        ax.legend(fontsize=7, loc="lower right")
    axes[-1, 0].set_xlabel(f"later-agent request, in run order (moving mean of {window}; grey: warm-up / pre-serve)")
    fig.suptitle(f"Corrections accepted and reuse over the run ({title})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- main


def _floats(s: str) -> List[float]:
    return [float(x) for x in s.split(",") if x.strip()]


def _ints(s: str) -> List[int]:
    return [int(x) for x in s.split(",") if x.strip()]


QUICK = dict(contexts=[128, 256], rates=[0.5], workflows=2, output_len=4, base_agents=3, agents=[2], rounds=[2],
             scaling_workflows=1, scaling_rate=0.0, scaling_context=128, warmup_workflows=2)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=None, help="a running sglang_kvshare server (default: start one)")
    ap.add_argument("--model-path", default=None, help="when starting a server (default: launch_server's SmolLM2)")
    ap.add_argument("--server-arg", action="append", default=[], help="extra launch_server flag (repeatable)")
    ap.add_argument("--server-pid", type=int, default=None, help="server PID for RSS (default: found from --url's port)")
    ap.add_argument("--plain-lora-url", default=None,
                    help="--agent-kind lora with --url: a running plain LoRA server (no --kvshare-lr-cache) for "
                         f"{', '.join(PLAIN_LORA_METHODS)}")
    ap.add_argument("--agent-kind", choices=("prompt",) + LORA_KINDS, default="prompt",
                    help="prompt: agents differ by system prompt; lora: by LoRA adapter (the shipped "
                         "solver/critic/final adapters, 3 agents; a server started here gets --enable-lora "
                         "--kvshare-lr-cache and the adapters; fullshared runs on a second, plain LoRA server); "
                         "lora-random: as lora with --base-agents and --agents, each agent with its own random-weight "
                         "adapter of rank --lora-rank generated at start (for timing: outputs mean nothing)")
    ap.add_argument("--lora-rank", type=int, default=8, help="--agent-kind lora-random: the adapters' rank")
    ap.add_argument("--methods", default=None,
                    help=f"default {','.join(DEFAULT_METHODS)}; with --agent-kind lora {','.join(LORA_METHODS)}")
    ap.add_argument("--contexts", type=_ints, default=[512, 1024, 2048], help="shared context lengths, tokens")
    ap.add_argument("--rates", type=_floats, default=[0.0, 0.05, 0.1, 0.2], help="workflow arrival rates, wf/s (0 = single stream)")
    ap.add_argument("--workflows", type=int, default=8, help="workflows per (context, rate, method)")
    ap.add_argument("--output-len", type=int, default=32, help="tokens per agent output (ignore_eos)")
    ap.add_argument("--base-agents", type=int, default=4)
    ap.add_argument("--base-rounds", type=int, default=1)
    ap.add_argument("--agents", type=_ints, default=[2, 4, 8], help="scaling sweep over agents ('' = skip)")
    ap.add_argument("--rounds", type=_ints, default=[2, 4, 8], help="scaling sweep over rounds ('' = skip)")
    ap.add_argument("--scaling-context", type=int, default=512)
    ap.add_argument("--scaling-rate", type=float, default=0.0)
    ap.add_argument("--scaling-workflows", type=int, default=2)
    ap.add_argument("--saturation-factor", type=float, default=2.0)
    ap.add_argument("--capacity", type=int, default=0,
                    help="also measure each method's capacity: --workflows workflows per context in a closed "
                         "loop with this many in flight (0: skip)")
    ap.add_argument("--server-per-method", action="store_true",
                    help="start a fresh server for each method (label): no anchor pool or gate threshold "
                         "learned under one method reaches another (fallback variants of one method share both "
                         "on one server)")
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="smoke run: " + json.dumps(QUICK))
    ap.add_argument("--no-warmup", action="store_true", help="skip the one short workflow per method that warms the engine")
    ap.add_argument("--warmup-workflows", type=int, default=10,
                    help="workflows (own contexts, same shape, single stream, not recorded) that warm each "
                         "correction method's anchor pools before its first point of a context length (with "
                         "--server-per-method every method's, so each fresh server is equally warm)")
    ap.add_argument("--pre-serve", type=int, default=0,
                    help="first serve this many workflows of other roles, 300-400-token contexts and the "
                         "correction methods kvcmas, kvcmas_plus, kvcomm, graphflow (a long-lived server)")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--out", type=Path, default=Path("results/serving.json"))
    ap.add_argument("--replot", action="store_true", help="only redraw plots and table from --out")
    args = ap.parse_args(argv)
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    lora = args.agent_kind in LORA_KINDS
    if args.methods is None:
        args.methods = ",".join(LORA_METHODS if lora else DEFAULT_METHODS)
    args.methods = [m for m in args.methods.split(",") if m]
    if args.agent_kind == "lora":  # three adapter agents; the agent-count sweep does not apply
        args.base_agents, args.agents = 3, []
    if lora:
        if args.url is not None and args.agent_kind == "lora-random":
            ap.error("--agent-kind lora-random starts its own servers (with the adapters it generates); drop --url")
        if args.lora_rank < 1:
            ap.error("--lora-rank must be >= 1")
        if args.url is not None and args.plain_lora_url is None and any(m in PLAIN_LORA_METHODS for m in args.methods):
            ap.error(f"--agent-kind lora with --url: {', '.join(PLAIN_LORA_METHODS)} runs on a plain LoRA server "
                     "(no --kvshare-lr-cache); give its URL with --plain-lora-url")
    if args.server_per_method and (args.url is not None or lora):
        ap.error("--server-per-method starts its own servers, for system-prompt agents: drop --url / --agent-kind")
    args.rates = sorted(args.rates)
    if args.capacity < 0:
        ap.error("--capacity must be >= 0")
    for name in ("workflows", "output_len", "base_agents", "base_rounds", "scaling_workflows"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def server_groups(args, adapters: Optional[Dict[str, str]] = None) -> List[tuple]:
    """(name, methods, url or None, launch_server flags) per server of the run, in order: one
    server; for LoRA agents the LR-cache server, then a plain LoRA server for PLAIN_LORA_METHODS
    (``adapters``: name -> path, instead of the shipped ones)."""
    if args.agent_kind not in LORA_KINDS:
        if args.server_per_method:
            return [(m, [m], None, list(args.server_arg)) for m in args.methods]
        return [("main", args.methods, args.url, list(args.server_arg))]
    lora_flags = list(LORA_SERVER_ARGS)
    if adapters:
        cut = lora_flags.index("--lora-paths")
        lora_flags = lora_flags[:cut] + ["--lora-paths", *(f"{n}={p}" for n, p in adapters.items())]
        lora_flags[lora_flags.index("--max-loras-per-batch") + 1] = str(max(4, len(adapters) + 1))  # + the base model
    plain = [m for m in args.methods if m in PLAIN_LORA_METHODS]
    groups = [("lr-cache", [m for m in args.methods if m not in plain], args.url, lora_flags),
              ("plain-lora", plain, args.plain_lora_url, [a for a in lora_flags if a != "--kvshare-lr-cache"])]
    return [(n, ms, url, flags + args.server_arg) for n, ms, url, flags in groups if ms]


def merge_parts(parts: List[Dict[str, Any]]) -> Dict[str, Any]:
    """One result from the runs on several servers: points of the same (context, rate, agents,
    rounds) joined, ratios to nonshared recomputed over all methods."""
    def join(lists, key):
        merged: Dict[tuple, Dict[str, Any]] = {}
        for pts in lists:
            for p in pts:
                k = key(p)
                if k in merged:
                    merged[k]["methods"].update(p["methods"])
                else:
                    merged[k] = dict(p, methods=dict(p["methods"]))
        for p in merged.values():
            p["ratios"] = ratios(p["methods"])
        return list(merged.values())

    pkey = lambda p: (p["context"], p["rate"], p["agents"], p["rounds"])  # noqa: E731
    points = sorted(join([x["points"] for x in parts], pkey), key=pkey)
    cap: Dict[str, Dict[str, Any]] = {}
    for x in parts:
        for ctx, rows in x["capacity"].items():
            cap.setdefault(ctx, {}).update(rows)
    return {
        "points": points, "skipped": [s for x in parts for s in x["skipped"]],
        "capacity": capacity_ratios(cap), "timeline": [r for x in parts for r in x["timeline"]],
        "scaling": {kind: join([x["scaling"][kind] for x in parts], pkey) for kind in ("agents", "rounds")},
    }


def run_methods(args, url: str, pid: Optional[int], tok, methods: List[str], bar, first: bool) -> Dict[str, Any]:
    """Every phase of the run for ``methods`` on one server."""
    margs = argparse.Namespace(**dict(vars(args), methods=methods))
    runner = Runner(margs, url, tok, pid, bar)
    if not args.no_warmup:  # one short single-stream workflow per method, not recorded
        bar.set_description("warm-up")
        for m in methods:
            spec = PointSpec(32, 0.0, m, args.base_agents if args.agent_kind in LORA_KINDS else 2, 1, 1, 2, 0,
                             args.agent_kind)
            run_point(url, spec, [make_context(tok, 32, f"warmup-{m}")], None, args.request_timeout, _NullBar())
    if first:
        runner.pre_serve()
    points, skipped = qps_sweep(runner, margs)
    cap = capacity(runner, margs) if args.capacity else {}
    return {"points": points, "skipped": skipped, "capacity": cap, "scaling": scaling_sweeps(runner, margs),
            "timeline": runner.timeline}


def main(argv=None) -> Dict[str, Any]:
    args = parse_args(argv)
    if args.replot:
        results = json.loads(args.out.read_text())
        plot(results, args.out)
        print(markdown(results))
        return results

    from transformers import AutoTokenizer

    from sglang_kvshare.methods import get_method, method_variant

    per_point = lambda a, r, w: turns_of(a, r) * w * len(args.methods)  # noqa: E731
    total = sum(per_point(args.base_agents, args.base_rounds, args.workflows) for _ in args.contexts for _ in args.rates)
    total += sum(per_point(a, args.base_rounds, args.scaling_workflows) for a in args.agents)
    total += per_point(args.base_agents, args.base_rounds, args.workflows) * len(args.contexts) * bool(args.capacity)
    total += sum(per_point(args.base_agents, r, args.scaling_workflows) for r in args.rounds)
    correcting = [m for m in args.methods
                  if args.server_per_method or get_method(method_variant(m)[0]).corrector is not None]
    total += len(args.contexts) * len(correcting) * args.warmup_workflows * turns_of(args.base_agents, args.base_rounds)
    total += args.pre_serve * turns_of(3, 1)
    parts, servers, adapters = [], [], None
    t0 = time.time()
    if args.agent_kind == "lora-random":
        from sglang_kvshare.assets import ensure_default_model

        n = max([args.base_agents] + list(args.agents))
        print(f"generating {n} random LoRA adapters of rank {args.lora_rank}", flush=True)
        adapters = random_adapters(args.model_path or str(ensure_default_model()), n, args.lora_rank,
                                   Path(tempfile.mkdtemp(prefix="serving-adapters-")), seed=args.seed)
    with tqdm(total=total, unit="req") as bar:
        for gi, (name, methods, url, flags) in enumerate(server_groups(args, adapters)):
            server, log_dir = None, None
            if url is None:
                from sglang_kvshare.testing.server import Server

                log_dir = Path(tempfile.mkdtemp(prefix="serving-"))
                argv_s = ["-m", "sglang_kvshare.launch_server"]
                if args.model_path:
                    argv_s += ["--model-path", args.model_path]
                bar.set_description(f"starting the {name} server")
                server = Server(argv_s + flags, log_dir / "server.log", timeout=900)
                url = server.url
            url = url.rstrip("/")
            try:
                info = requests.get(url + "/get_model_info", timeout=30).json()
                tok = AutoTokenizer.from_pretrained(info.get("tokenizer_path") or info["model_path"])
                pid = server.proc.pid if server else ((args.server_pid if gi == 0 else None) or find_server_pid(url))
                servers.append({"name": name, "methods": methods, "url": url, "flags": flags,
                                "model_path": info.get("model_path"), "started_here": server is not None,
                                "pid": pid, "log": str(log_dir / "server.log") if log_dir else None})
                parts.append(run_methods(args, url, pid, tok, methods, bar, first=gi == 0 or args.server_per_method))
            finally:
                if server is not None:
                    server.stop()
    merged = merge_parts(parts)
    results = {
        "benchmark": "serving",
        "ttft": "client wall time from POST to the first SSE data chunk of a streamed /generate (127.0.0.1)",
        "rho": "reused_tokens / tokens of shared segments, summed over requests (meta_info.kvshare)",
        "memory": "peak RSS summed over the server process tree (psutil, 0.25 s); GPU: nvidia-smi memory.used",
        "ratios": f"method / {BASELINE} at the same point of the same run",
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "servers": servers,
        "host": {"machine": platform.machine(), "processor": platform.processor(), "python": platform.python_version()},
        "wall_s": time.time() - t0,
        "qps_sweep": merged["points"],
        "saturation": saturation(merged["points"]),
        "skipped": merged["skipped"],
        "capacity": merged["capacity"],
        "timeline": merged["timeline"],
        "scaling": merged["scaling"],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    pngs = [] if args.no_plots else plot(results, args.out)
    print(markdown(results))
    logs = [s["log"] for s in servers if s["log"]]
    print(f"\nwrote {args.out}" + "".join(f", {p}" for p in pngs) + (f" (server logs: {', '.join(logs)})" if logs else ""))
    return results


if __name__ == "__main__":
    main()
