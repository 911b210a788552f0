"""``python -m benchmarks.coverage``: part 1 (fullshared runs, the DroidSpeak profile, coverage by
criterion) and part 2 (the engine's recompute methods on a server with that profile)."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import uuid
from pathlib import Path

from benchmarks.coverage.pairs import AttentionReader, analyse_coverage, build_profile
from benchmarks.coverage.report import EngineSummary, coverage_table, engine_table, plot
from benchmarks.coverage.selection import CHECK_LAYER, MAX_GROUPS, RHOS, summarise_coverage
from benchmarks.fidelity.options import RECOMPUTE_METHODS, Arm
from benchmarks.fidelity.runner import Backend, Report, git_head, run_plan

METHODS = RECOMPUTE_METHODS


def parse_args(argv=None):
    from benchmarks import coverage

    ap = argparse.ArgumentParser(prog="python -m benchmarks.coverage", description=coverage.__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", type=int, default=40, help="evaluation tasks (default 40, as benchmarks.fidelity)")
    ap.add_argument("--profile-tasks", type=int, default=8, help="DroidSpeak profiling tasks (default 8)")
    ap.add_argument("--quick", action="store_true", help="1 profiling + 2 evaluation tasks")
    ap.add_argument("--dataset", default="mmlu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--out", default="results/coverage.json")
    ap.add_argument("--profile-out", default="results/droidspeak_profile_smollm2.json")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--skip-engine", action="store_true", help="part 1 only")
    args = ap.parse_args(argv)
    if args.quick:
        args.tasks, args.profile_tasks = min(args.tasks, 2), min(args.profile_tasks, 1)
    # what benchmarks.fidelity's Backend / run_plan read
    args.agents, args.server_url, args.dump_dir, args.keep_dumps = "prompt", None, None, True
    args.max_total_tokens, args.tau, args.server_timeout, args.request_timeout = 32768, 0.3, 900, 900
    args.sanity_tasks = 1
    return args


def main(argv=None) -> int:
    from benchmarks import coverage
    from benchmarks.datasets import load_tasks
    from sglang_kvshare.assets import ensure_default_model
    from sglang_kvshare.workflows import get_roles

    args = parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="kvshare-coverage-"))
    workdir.mkdir(parents=True, exist_ok=True)
    # the evaluation tasks are the fidelity benchmark's (same dataset, count and seed); the
    # profiling tasks are other tasks of the dataset
    eval_tasks = load_tasks(args.dataset, args.tasks, seed=args.seed)
    taken = {t.id for t in eval_tasks}
    more = load_tasks(args.dataset, args.tasks + args.profile_tasks, seed=args.seed + 1)
    prof_tasks = [t for t in more if t.id not in taken][: args.profile_tasks]
    roles = get_roles(args.dataset)
    tag = uuid.uuid4().hex[:8]
    cfg = {
        "dataset": args.dataset,
        "profile_tasks": [t.id for t in prof_tasks],
        "eval_tasks": [t.id for t in eval_tasks],
        "rhos": list(RHOS),
        "check_layer": CHECK_LAYER,
        "max_groups": MAX_GROUPS,
        "methods": args.methods.split(","),
        "max_new_tokens": args.max_new_tokens,
        "argv": sys.argv[1:],
        "git_head": git_head(),
        "workdir": str(workdir),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    report = Report(out, cfg, coverage.__doc__.split("Usage")[0].strip())

    # part 1: fullshared turns and their dense shadows, dumps kept
    backend = Backend(args, workdir, "coverage")
    try:
        plan = [Arm("fullshared", "fullshared")]
        run_plan(args, backend, prof_tasks, roles, plan, tag, report, "profile")
        run_plan(args, backend, eval_tasks, roles, plan, tag, report, "coverage_source")
    finally:
        backend.stop()
    # the payload's annotation is needed to rebuild prompt ids; run_one keeps it per turn
    profile = build_profile(report.runs("profile")["fullshared"], backend.dump_root)
    profile_json = {
        "model": "SmolLM2-135M-Instruct",
        "dataset": args.dataset,
        "tasks": [t.id for t in prof_tasks],
        "samples": profile.num_samples,
        "relative": profile.relative,
        "layer_deviation": [round(float(x), 8) for x in profile.layer_deviation()],
    }
    Path(args.profile_out).write_text(json.dumps(profile_json, indent=1))
    reader = AttentionReader(str(ensure_default_model()))
    pairs = analyse_coverage(report.runs("coverage_source")["fullshared"], backend.dump_root, profile, reader)
    report.sections["coverage_pairs"] = pairs
    coverage_summary = summarise_coverage(pairs)
    report.sections["coverage"] = coverage_summary
    cfg["segments"] = coverage_summary.segments
    groups = {str(rho): profile.choose_groups(round(1 - rho, 6), MAX_GROUPS) for rho in RHOS}
    report.sections["droidspeak_groups"] = groups
    report.save()
    print("\ncoverage:\n" + coverage_table(coverage_summary) + "\n", flush=True)

    # part 2: the engine's methods at rho 0.9 and 0.8
    summary = {}
    if not args.skip_engine:
        flags = ["--kvshare-droidspeak-profile", str(Path(args.profile_out).resolve())]
        backend = Backend(args, workdir, "engine", extra_flags=flags)
        try:
            plan = [Arm("nonshared", "nonshared"), Arm("fullshared", "fullshared")]
            plan += [Arm(f"{m}@rho{rho}", m, None, round(1 - rho, 6)) for rho in RHOS for m in args.methods.split(",")]
            run_plan(args, backend, eval_tasks, roles, plan, tag, report, "main")
        finally:
            backend.stop()
        summary = report.summaries("main")
        report.sections["main"] = {label: EngineSummary(s) for label, s in summary.items()}
        print("\nengine:\n" + engine_table(summary) + "\n", flush=True)
    cfg["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    report.save()
    title = (
        f"Selective recomputation, SmolLM2-135M, {len(eval_tasks)} {args.dataset} tasks "
        f"({coverage_summary.segments} reused segments)"
    )
    plot(coverage_summary, summary, title, out.with_suffix(".png"))
    print(f"plot: {out.with_suffix('.png')}", flush=True)
    return 0
