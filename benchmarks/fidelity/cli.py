"""``python -m benchmarks.fidelity``: the main run (a server per group of methods), the tau sweep,
or (``--from-json``) the summaries of an earlier run recomputed from its raw records."""

from __future__ import annotations

import json
import platform
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Dict

from benchmarks.fidelity.options import TAU_METHODS, TOP_K, TOPOLOGY, Arm, measured_and_warmup_tasks, parse_args
from benchmarks.fidelity.records import run_from_json
from benchmarks.fidelity.report import markdown_table, plot_methods, plot_sweep
from benchmarks.fidelity.runner import Backend, Report, git_head, jsonable, run_plan, write_results
from benchmarks.fidelity.summary import aggregate
from sglang_kvshare.methods import get_method, method_variant
from sglang_kvshare.workflows import get_roles, lora_conversation_roles


def sweep_png(out: Path) -> Path:
    return out.with_name(out.stem.replace("_tau", "") + "_tau.png")


def reaggregate(src: Path, out: Path) -> None:
    """Summaries, table and plots recomputed from the ``*_runs`` raw records of ``src``."""
    results = json.loads(src.read_text())
    lora = results.get("config", {}).get("agents_kind") == "lora"
    for section in ("main", "tau_sweep"):
        runs = results.get(section + "_runs")
        if not runs:
            continue
        summary = {label: aggregate([run_from_json(r) for r in rs]) for label, rs in runs.items()}
        results[section] = jsonable(summary)
        print(f"\n{section} ({src}):\n" + markdown_table(summary, lora=lora) + "\n")
        if section == "main":
            plot_methods(summary, out.with_suffix(".png"), lora=lora)
        else:
            plot_sweep(summary, sweep_png(out))
    write_results(results, out)


def config(args, tasks, warmup_tasks, roles, tag: str, workdir: Path) -> Dict[str, Any]:
    """The run's record of what it ran (the ``config`` of the results JSON)."""
    return {
        "agents_kind": args.agents,
        "adapter_targets": args.adapter_targets if args.agents == "lora" else None,
        "dataset": args.dataset,
        "tasks": [t.id for t in tasks],
        "topology": TOPOLOGY,
        "agents": [r.name for r in roles.roles],
        "methods": args.method_list,
        "warmup_tasks": [t.id for t in warmup_tasks],
        "tau": args.tau,
        "tau_sweep": args.taus,
        "sweep_methods": args.sweep_methods.split(","),
        "max_new_tokens": args.max_new_tokens,
        "top_k": TOP_K,
        "temperature": 0.0,
        "max_total_tokens": args.max_total_tokens,
        "run_tag": tag,
        "workdir": str(workdir),
        "argv": sys.argv[1:],
        "host": platform.node(),
        "git_head": git_head(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def server_groups(args, plan):
    """(server name, with the LR cache, arms) of the main run: one server, one per method
    (``--server-per-method``), or with LoRA agents the LR-cache methods (and their nonshared
    reference) on an LR-cache server and the rest on a plain LoRA server."""
    if args.agents == "lora":
        lr = [a for a in plan if a.method == "nonshared" or get_method(method_variant(a.method)[0]).lr_sharing]
        return [("main-lr", True, lr), ("main-full", False, [a for a in plan if a not in lr])]
    if args.server_per_method:
        return [(f"main-{a.label}", False, [a]) for a in plan]
    return [("main", False, plan)]


def main(argv=None) -> int:
    from benchmarks import fidelity

    args = parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.from_json:
        reaggregate(Path(args.from_json), out)
        return 0
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="kvshare-fidelity-"))
    workdir.mkdir(parents=True, exist_ok=True)
    tasks, warmup_tasks = measured_and_warmup_tasks(args.dataset, args.tasks, args.warmup_tasks, args.seed)
    lora = args.agents == "lora"
    roles = lora_conversation_roles(args.dataset) if lora else get_roles(args.dataset)
    tag = uuid.uuid4().hex[:8]
    cfg = config(args, tasks, warmup_tasks, roles, tag, workdir)
    report = Report(out, cfg, fidelity.__doc__.split("Usage")[0].strip())

    print(f"fidelity: {len(tasks)} {args.dataset} tasks, results -> {out}, workdir {workdir}", flush=True)
    if not args.sweep_only and args.method_list:
        # labels of the main run are the plain method names; its tau (None: the server's online tau) is in the config
        plan = [Arm(m, m, args.tau if method_variant(m)[0] in TAU_METHODS else None) for m in args.method_list]
        profile = []
        if args.droidspeak_profile:
            profile = ["--kvshare-droidspeak-profile", str(Path(args.droidspeak_profile).resolve())]
        for name, lr_cache, group in server_groups(args, plan):
            if not group:
                continue
            backend = Backend(args, workdir, name, lr_cache=lr_cache, extra_flags=profile)
            try:
                run_plan(args, backend, tasks, roles, group, tag, report, "main", warmup_tasks)
            finally:
                backend.stop()
        summary = report.summaries("main")
        plot_methods(summary, out.with_suffix(".png"), lora=lora)
        print("\n" + markdown_table(summary, lora=lora) + "\n", flush=True)
        print(f"plot: {out.with_suffix('.png')}", flush=True)
    if args.taus:
        sweep_tasks = tasks[: args.sweep_tasks] if args.sweep_tasks else tasks
        backend = Backend(args, workdir, "sweep")  # fresh anchor pools
        try:
            plan = [Arm(f"{m}@{t:g}", m, t) for t in args.taus for m in args.sweep_methods.split(",")]
            run_plan(args, backend, sweep_tasks, roles, plan, tag, report, "tau_sweep")
        finally:
            backend.stop()
        plot_sweep(report.summaries("tau_sweep"), sweep_png(out))
        print("\n" + markdown_table(report.summaries("tau_sweep")) + "\n", flush=True)
        print(f"plot: {sweep_png(out)}", flush=True)
    report.config["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    report.save()
    return 0
