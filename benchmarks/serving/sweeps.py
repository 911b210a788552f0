"""The phases of a run on one server: warm-up, pre-serve, the rate sweep (until every method
saturates), the closed-loop capacity and the scaling sweeps (``run_methods`` runs them in order)."""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Any, Dict, List, Optional, Tuple

from benchmarks.serving.point import run_point
from benchmarks.serving.results import Capacity, CapacityRow, Part, Point, PointResult, capacity_ratios
from benchmarks.serving.workload import LORA_KINDS, PointSpec, make_context


class NullBar:
    """A progress bar that shows nothing."""

    def update(self, n: int = 1) -> None:
        pass


def _is_correcting(method: str) -> bool:
    from sglang_kvshare.methods import get_method, method_variant

    return get_method(method_variant(method)[0]).corrector is not None


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

    def spec(
        self, context: int, rate: float, method: str, agents: int, rounds: int, workflows: int, seed: int, **kw
    ) -> PointSpec:
        """A point of this run's shape (``--output-len``, ``--agent-kind``)."""
        return PointSpec(
            context=context,
            rate=rate,
            method=method,
            agents=agents,
            rounds=rounds,
            workflows=workflows,
            output_len=self.args.output_len,
            seed=seed,
            kind=self.args.agent_kind,
            **kw,
        )

    def run(self, spec: PointSpec, tag: str, phase: str) -> PointResult:
        pid = self.pid if phase == "measured" else None
        res = run_point(
            self.url, spec, self.contexts(spec.context, spec.workflows, tag), pid, self.args.request_timeout, self.bar
        )
        where = {"phase": phase, "context": res.context, "rate": res.rate, "method": res.method}
        self.timeline += [{**where, **r} for r in res.requests_log]
        return res

    def warm_up(self, context: int, method: str, agents: int, rounds: int) -> None:
        """``--warmup-workflows`` single-stream workflows, not recorded (correction methods)."""
        n = self.args.warmup_workflows
        if n <= 0 or (context, method) in self._warm or not (self.args.server_per_method or _is_correcting(method)):
            return
        self._warm.add((context, method))
        self.bar.set_description(f"warm-up ctx {context} {method} ({n} workflows)")
        self.run(self.spec(context, 0.0, method, agents, rounds, workflows=n, seed=0), "warmup", "warmup")

    def pre_serve(self) -> None:
        """``--pre-serve`` workflows of other roles, short contexts and other correction methods
        first: the server the user meets has been up for a while."""
        n = self.args.pre_serve
        methods = ("kvcmas", "kvcmas_plus", "kvcomm", "graphflow")
        for k in range(n):
            self.bar.set_description(f"pre-serve {k + 1}/{n}")
            spec = self.spec(
                300 + 100 * (k % 2),
                0.0,
                methods[k % len(methods)],
                agents=3,
                rounds=1,
                workflows=1,
                seed=k,
                prefix="other_",
            )
            self.run(spec, f"pre{k}", "pre-serve")

    def point(self, context: int, rate: float, agents: int, rounds: int, workflows: int, seed: int) -> Point:
        by_method = {}
        for method in self.args.methods:
            self.warm_up(context, method, agents, rounds)
            self.bar.set_description(f"ctx {context} rate {rate} a{agents} r{rounds} {method}")
            spec = self.spec(context, rate, method, agents, rounds, workflows, seed)
            by_method[method] = self.run(spec, f"r{rate}-a{agents}-r{rounds}", "measured")
        return Point(context=context, rate=rate, agents=agents, rounds=rounds, methods=by_method)


def qps_sweep(runner: Runner, args) -> Tuple[List[Point], List[Dict[str, Any]]]:
    """Per context, the rates in order until every method is saturated (its median workflow
    latency over ``--saturation-factor`` x its latency at the lowest rate measured, or errors);
    the points, and the rates skipped."""
    points, skipped = [], []
    for ci, context in enumerate(args.contexts):
        baseline_lat: Dict[str, float] = {}
        for ri, rate in enumerate(args.rates):
            p = runner.point(
                context, rate, args.base_agents, args.base_rounds, args.workflows, args.seed + 1000 * ci + ri
            )
            marked = {}
            for m, res in p.methods.items():
                lat = res.workflow_latency_s.p50 if res.workflow_latency_s else None
                if m not in baseline_lat and lat is not None:
                    baseline_lat[m] = lat
                sat = (
                    rate > 0
                    and lat is not None
                    and m in baseline_lat
                    and ri > 0
                    and lat > args.saturation_factor * baseline_lat[m]
                ) or res.errors > 0
                marked[m] = replace(res, saturated=bool(sat))
            points.append(replace(p, methods=marked))
            if all(r.saturated for r in marked.values()) and ri + 1 < len(args.rates):
                skipped += [
                    {"context": context, "rate": r, "reason": f"all methods saturated at {rate}"}
                    for r in args.rates[ri + 1 :]
                ]
                break
    return points, skipped


def capacity(runner: Runner, args) -> Capacity:
    """Closed loop (``--capacity C``): per context and method, ``--workflows`` workflows with C in
    flight (a new one starts when one ends), after the method's warm-up. The completion rate is
    the arrival rate the server can sustain: its saturation rate."""
    out: Capacity = {}
    for context in args.contexts:
        rows = out.setdefault(str(context), {})
        for method in args.methods:
            runner.warm_up(context, method, args.base_agents, args.base_rounds)
            spec = runner.spec(
                context,
                0.0,
                method,
                args.base_agents,
                args.base_rounds,
                args.workflows,
                args.seed,
                concurrency=args.capacity,
            )
            runner.bar.set_description(f"capacity ctx {context} C={args.capacity} {method}")
            rows[method] = CapacityRow.of(runner.run(spec, f"cap{args.capacity}", "capacity"))
    return capacity_ratios(out)


def scaling_sweeps(runner: Runner, args) -> Dict[str, Tuple[Point, ...]]:
    """One factor varied (``--agents``, ``--rounds``), the other at its base value."""
    ctx, rate, n, seed = args.scaling_context, args.scaling_rate, args.scaling_workflows, args.seed + 7
    return {
        "agents": tuple(runner.point(ctx, rate, a, args.base_rounds, n, seed) for a in args.agents),
        "rounds": tuple(runner.point(ctx, rate, args.base_agents, r, n, seed) for r in args.rounds),
    }


def run_methods(args, url: str, pid: Optional[int], tok, methods: List[str], bar, first: bool) -> Part:
    """Every phase of the run for ``methods`` on one server (``first``: also pre-serve)."""
    margs = argparse.Namespace(**dict(vars(args), methods=methods))
    runner = Runner(margs, url, tok, pid, bar)
    if not args.no_warmup:  # one short single-stream workflow per method, not recorded
        bar.set_description("warm-up")
        agents = args.base_agents if args.agent_kind in LORA_KINDS else 2
        for m in methods:
            spec = PointSpec(
                context=32,
                rate=0.0,
                method=m,
                agents=agents,
                rounds=1,
                workflows=1,
                output_len=2,
                seed=0,
                kind=args.agent_kind,
            )
            run_point(url, spec, [make_context(tok, 32, f"warmup-{m}")], None, args.request_timeout, NullBar())
    if first:
        runner.pre_serve()
    points, skipped = qps_sweep(runner, margs)
    cap = capacity(runner, margs) if args.capacity else {}
    scaling = scaling_sweeps(runner, margs)
    return Part(
        points=tuple(points), skipped=tuple(skipped), capacity=cap, scaling=scaling, timeline=tuple(runner.timeline)
    )
