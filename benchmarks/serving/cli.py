"""Serving benchmark: controlled multi-agent traces at rising workflow arrival rates, per method.

The command line (``python -m benchmarks.serving``; see the package's docstring for the workload
and the metrics): ``parse_args`` and ``main``, which runs every server's phases, writes the JSON
(``--out``), draws the figures and prints the tables.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Dict, List

from tqdm import tqdm

from benchmarks.serving.plots import plot
from benchmarks.serving.report import markdown
from benchmarks.serving.results import merge_parts
from benchmarks.serving.servers import run_on_servers
from benchmarks.serving.workload import (
    BASELINE,
    DEFAULT_METHODS,
    LORA_KINDS,
    LORA_METHODS,
    PLAIN_LORA_METHODS,
    random_adapters,
    turns_of,
)


def _floats(s: str) -> List[float]:
    return [float(x) for x in s.split(",") if x.strip()]


def _ints(s: str) -> List[int]:
    return [int(x) for x in s.split(",") if x.strip()]


QUICK = dict(
    contexts=[128, 256],
    rates=[0.5],
    workflows=2,
    output_len=4,
    base_agents=3,
    agents=[2],
    rounds=[2],
    scaling_workflows=1,
    scaling_rate=0.0,
    scaling_context=128,
    warmup_workflows=2,
)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--url", default=None, help="a running sglang_kvshare server (default: start one)")
    ap.add_argument("--model-path", default=None, help="when starting a server (default: launch_server's SmolLM2)")
    ap.add_argument("--server-arg", action="append", default=[], help="extra launch_server flag (repeatable)")
    ap.add_argument(
        "--server-pid", type=int, default=None, help="server PID for RSS (default: found from --url's port)"
    )
    ap.add_argument(
        "--plain-lora-url",
        default=None,
        help="--agent-kind lora with --url: a running plain LoRA server (no --kvshare-lr-cache) for "
        f"{', '.join(PLAIN_LORA_METHODS)}",
    )
    ap.add_argument(
        "--agent-kind",
        choices=("prompt",) + LORA_KINDS,
        default="prompt",
        help="prompt: agents differ by system prompt; lora: by LoRA adapter (the shipped "
        "solver/critic/final adapters, 3 agents; a server started here gets --enable-lora "
        "--kvshare-lr-cache and the adapters; fullshared runs on a second, plain LoRA server); "
        "lora-random: as lora with --base-agents and --agents, each agent with its own random-weight "
        "adapter of rank --lora-rank generated at start (for timing: outputs mean nothing)",
    )
    ap.add_argument("--lora-rank", type=int, default=8, help="--agent-kind lora-random: the adapters' rank")
    ap.add_argument(
        "--methods",
        default=None,
        help=f"default {','.join(DEFAULT_METHODS)}; with --agent-kind lora {','.join(LORA_METHODS)}",
    )
    ap.add_argument("--contexts", type=_ints, default=[512, 1024, 2048], help="shared context lengths, tokens")
    ap.add_argument(
        "--rates", type=_floats, default=[0.0, 0.05, 0.1, 0.2], help="workflow arrival rates, wf/s (0 = single stream)"
    )
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
    ap.add_argument(
        "--capacity",
        type=int,
        default=0,
        help="also measure each method's capacity: --workflows workflows per context in a closed "
        "loop with this many in flight (0: skip)",
    )
    ap.add_argument(
        "--server-per-method",
        action="store_true",
        help="start a fresh server for each method (label): no anchor pool or gate threshold "
        "learned under one method reaches another (fallback variants of one method share both "
        "on one server)",
    )
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="smoke run: " + json.dumps(QUICK))
    ap.add_argument(
        "--no-warmup", action="store_true", help="skip the one short workflow per method that warms the engine"
    )
    ap.add_argument(
        "--warmup-workflows",
        type=int,
        default=10,
        help="workflows (own contexts, same shape, single stream, not recorded) that warm each "
        "correction method's anchor pools before its first point of a context length (with "
        "--server-per-method every method's, so each fresh server is equally warm)",
    )
    ap.add_argument(
        "--pre-serve",
        type=int,
        default=0,
        help="first serve this many workflows of other roles, 300-400-token contexts and the "
        "correction methods kvcmas, kvcmas_plus, kvcomm, graphflow (a long-lived server)",
    )
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
            ap.error(
                f"--agent-kind lora with --url: {', '.join(PLAIN_LORA_METHODS)} runs on a plain LoRA server "
                "(no --kvshare-lr-cache); give its URL with --plain-lora-url"
            )
    if args.server_per_method and (args.url is not None or lora):
        ap.error("--server-per-method starts its own servers, for system-prompt agents: drop --url / --agent-kind")
    args.rates = sorted(args.rates)
    if args.capacity < 0:
        ap.error("--capacity must be >= 0")
    for name in ("workflows", "output_len", "base_agents", "base_rounds", "scaling_workflows"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def expected_requests(args) -> int:
    """Requests the run will send (for the progress bar)."""
    from sglang_kvshare.methods import get_method, method_variant

    def per_point(agents: int, rounds: int, workflows: int) -> int:
        return turns_of(agents, rounds) * workflows * len(args.methods)

    base = per_point(args.base_agents, args.base_rounds, args.workflows)
    total = base * len(args.contexts) * len(args.rates)
    total += sum(per_point(a, args.base_rounds, args.scaling_workflows) for a in args.agents)
    total += base * len(args.contexts) * bool(args.capacity)
    total += sum(per_point(args.base_agents, r, args.scaling_workflows) for r in args.rounds)
    correcting = [
        m for m in args.methods if args.server_per_method or get_method(method_variant(m)[0]).corrector is not None
    ]
    total += len(args.contexts) * len(correcting) * args.warmup_workflows * turns_of(args.base_agents, args.base_rounds)
    return total + args.pre_serve * turns_of(3, 1)


def main(argv=None) -> Dict[str, Any]:
    args = parse_args(argv)
    if args.replot:
        results = json.loads(args.out.read_text())
        plot(results, args.out)
        print(markdown(results))
        return results

    total = expected_requests(args)
    adapters = None
    t0 = time.time()
    if args.agent_kind == "lora-random":
        from sglang_kvshare.assets import ensure_default_model

        n = max([args.base_agents] + list(args.agents))
        print(f"generating {n} random LoRA adapters of rank {args.lora_rank}", flush=True)
        adapters = random_adapters(
            args.model_path or str(ensure_default_model()),
            n,
            args.lora_rank,
            Path(tempfile.mkdtemp(prefix="serving-adapters-")),
            seed=args.seed,
        )
    with tqdm(total=total, unit="req") as bar:
        parts, servers = run_on_servers(args, adapters, bar)
    merged = merge_parts(parts)
    results = {
        "benchmark": "serving",
        "ttft": "client wall time from POST to the first SSE data chunk of a streamed /generate (127.0.0.1)",
        "rho": "reused_tokens / tokens of shared segments, summed over requests (meta_info.kvshare)",
        "memory": "peak RSS summed over the server process tree (psutil, 0.25 s); GPU: nvidia-smi memory.used",
        "ratios": f"method / {BASELINE} at the same point of the same run",
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "servers": [asdict(s) for s in servers],
        "host": {"machine": platform.machine(), "processor": platform.processor(), "python": platform.python_version()},
        "wall_s": time.time() - t0,
        **merged.to_json(),  # qps_sweep, saturation, skipped, capacity, timeline, scaling
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    pngs = [] if args.no_plots else plot(results, args.out)
    print(markdown(results))
    logs = [s.log for s in servers if s.log]
    print(
        f"\nwrote {args.out}" + "".join(f", {p}" for p in pngs) + (f" (server logs: {', '.join(logs)})" if logs else "")
    )
    return results


if __name__ == "__main__":
    main()
