"""The fidelity benchmark's methods, role adapters, task selection and command line."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from benchmarks.datasets import load_tasks
from sglang_kvshare.methods import method_variant
from sglang_kvshare.workflows import lora_conversation_roles

MAIN_METHODS = ("nonshared", "fullshared", "kvcmas", "kvcmas_nonchained", "kvcomm", "graphflow")
# --agents lora: agents that differ by LoRA adapter (PReCache); fullshared runs on a server
# without the LR cache (it reuses the previous agent's full cache, value delta included)
LORA_METHODS = ("nonshared", "fullshared", "baseshared", "prelr_shared", "rebase_shared_lp")
# rebase_shared_db builds the same cache as rebase_shared_lp (tests/integration/test_precache_engine.py)
RECOMPUTE_METHODS = ("cacheblend", "droidspeak", "relaycaching")  # see benchmarks.coverage
KNOWN_METHODS = MAIN_METHODS + ("kvcmas_plus",) + LORA_METHODS[2:] + ("rebase_shared_db",) + RECOMPUTE_METHODS
REPO = Path(__file__).resolve().parents[2]
TAU_METHODS = {"kvcmas", "kvcmas_nonchained", "kvcmas_plus", "kvcomm"}  # graphflow has no gate
TOPOLOGY = "sequential"
TOP_K = 20


@dataclass(frozen=True)
class Arm:
    """One label of a run: ``method`` under ``label``, with a per-request gate threshold ``tau``
    (None: the server's) and selective-recomputation budget ``recompute_ratio`` (None: none sent)."""

    label: str
    method: str
    tau: Optional[float] = None
    recompute_ratio: Optional[float] = None


def adapters(targets: str = "qv") -> dict:
    """The shipped adapters of the LoRA roles (``lora_conversation_roles``) on ``targets``
    (``qv`` or ``qkvo``), by adapter name."""
    names = [r.lora_path for r in lora_conversation_roles().roles]
    return {name: REPO / "adapters" / f"smollm2-{name}-{targets}-r8" for name in names}


def measured_and_warmup_tasks(dataset: str, n: int, warmup: int, seed: int = 0):
    """(the ``n`` measured tasks, ``warmup`` other tasks): the measured ones are those of a run
    without warm-up (``load_tasks`` keeps a smaller n a subset of a larger one)."""
    tasks = load_tasks(dataset, n, seed=seed)
    measured = {t.id for t in tasks}
    rest = [t for t in load_tasks(dataset, n + warmup, seed=seed) if t.id not in measured]
    return tasks, rest[:warmup]


def _parser() -> argparse.ArgumentParser:
    from benchmarks import fidelity

    ap = argparse.ArgumentParser(prog="python -m benchmarks.fidelity", description=fidelity.__doc__.split("\n\n")[0])
    add = ap.add_argument
    add(
        "--agents",
        choices=("prompt", "lora"),
        default="prompt",
        help="prompt: agents differ by system prompt (KVCMAS); lora: by LoRA adapter "
        "(PReCache; the adapters in adapters/, one growing chat)",
    )
    add(
        "--adapter-targets",
        choices=("qv", "qkvo"),
        default="qv",
        help="with --agents lora: the shipped role adapters on q/v or on q/k/v/o",
    )
    add("--dataset", default=None, help="mmlu | gsm8k | gpqa | humaneval (default mmlu; gsm8k with --agents lora)")
    add("--tasks", type=int, default=40, help="tasks (default 40)")
    add("--quick", action="store_true", help="4 tasks, smoke run")
    add(
        "--warmup-tasks",
        type=int,
        default=0,
        help="tasks (distinct from the measured ones) that the correction methods run "
        "first, unrecorded, so the measured tasks meet warm anchor pools",
    )
    add("--seed", type=int, default=0, help="task sampling seed of load_tasks")
    add(
        "--methods",
        default=None,
        help=f"comma list of {', '.join(KNOWN_METHODS)} (default: {', '.join(MAIN_METHODS)}; "
        f"with --agents lora: {', '.join(LORA_METHODS)})",
    )
    add(
        "--tau",
        type=float,
        default=None,
        help="a fixed gate threshold of the main run, sent per request to the gated methods "
        "(default: the server's own, tuned online to --kvshare-target-rho)",
    )
    add("--tau-sweep", default="", help="e.g. 0.1,0.3,0.5,0.7,0.9")
    add("--sweep-methods", default="kvcmas,kvcomm")
    add("--sweep-tasks", type=int, default=None, help="tasks of the sweep (default --tasks)")
    add("--sweep-only", action="store_true", help="skip the main run")
    add("--max-new-tokens", type=int, default=32)
    add("--sanity-tasks", type=int, default=2, help="tasks on which nonshared is shadowed too (determinism check)")
    add(
        "--out",
        default=None,
        help="JSON path (default results/fidelity.json, results/fidelity_tau.json with --sweep-only)",
    )
    add("--max-total-tokens", type=int, default=32768)
    add("--server-url", default=None, help="use a running server instead of starting one")
    add(
        "--server-per-method",
        action="store_true",
        help="a fresh server for each method of the main run (fallback variants of one method "
        "share anchor pools and the gate threshold on one server)",
    )
    add("--dump-dir", default=None, help="its --kvshare-dump-dir (with --server-url)")
    add("--workdir", default=None, help="server logs and dumps (default: a temp dir)")
    add("--keep-dumps", action="store_true")
    add(
        "--droidspeak-profile",
        default=None,
        help="--kvshare-droidspeak-profile of the started servers (see benchmarks.coverage)",
    )
    add("--server-timeout", type=float, default=900)
    add("--request-timeout", type=float, default=900)
    add(
        "--from-json",
        default=None,
        help="no server: recompute the summaries, table and plots of an earlier run's "
        "JSON from its raw records (written back to --out, default: that file)",
    )
    return ap


def parse_args(argv=None):
    ap = _parser()
    args = ap.parse_args(argv)
    if args.quick:
        args.tasks = min(args.tasks, 4)
    if args.warmup_tasks < 0:
        ap.error("--warmup-tasks must be >= 0")
    lora = args.agents == "lora"
    args.dataset = args.dataset or ("gsm8k" if lora else "mmlu")
    if args.methods is None:
        args.methods = ",".join(LORA_METHODS if lora else MAIN_METHODS)
    methods = [m for m in args.methods.split(",") if m]
    for m in methods + args.sweep_methods.split(","):
        try:
            base = method_variant(m)[0] if m else m
        except KeyError as e:
            ap.error(e.args[0])
        if m and base not in KNOWN_METHODS:
            ap.error(f"unknown method {m!r}")
    args.method_list = methods
    args.taus = [float(t) for t in args.tau_sweep.split(",") if t]
    if any(not 0.0 <= t <= 1.0 for t in args.taus + ([args.tau] if args.tau is not None else [])):
        ap.error("tau must be in [0, 1]")
    if args.server_per_method and (lora or args.server_url):
        ap.error("--server-per-method starts its own servers, for prompt agents: drop --server-url / --agents lora")
    if lora and args.taus:
        ap.error("--tau-sweep is for the gated prompt-agent methods, not --agents lora")
    if args.sweep_only and not args.taus:
        ap.error("--sweep-only needs --tau-sweep")
    if args.out is None:
        if args.from_json:
            args.out = args.from_json
        else:
            sweep, lora_out = "results/fidelity_tau.json", "results/fidelity_lora.json"
            args.out = sweep if args.sweep_only else lora_out if lora else "results/fidelity.json"
    return args
