"""Unmodified agent apps: later-agent time to first token on plain SGLang, with automatic detection
(``--kvshare-auto kvcmas``), and with the hand-annotated graph, measured side by side in one run.

The apps are the real frameworks, run unchanged in their own venv (``scripts/setup.sh``):

- ``examples/langgraph_agents.py``: a LangGraph graph solver -> critic -> final (``ChatOpenAI``,
  streaming), each workflow with its own report (distinct ~2K-token contexts);
- ``examples/autogen_team.py``: an AutoGen round-robin team analyst -> reviewer -> editor.

Servers (one at a time, each fresh, the real default model SmolLM2-135M-Instruct on the CPU):

- ``plain``: stock SGLang (``SGLANG_PLUGINS=none``), the apps as they are;
- ``auto``: ``python -m sglang_kvshare.launch_server --kvshare-auto kvcmas``, the apps as they are
  (only ``base_url`` and the ``X-KVShare-Workflow`` default header, which they always send);
- ``annotated``: ``python -m sglang_kvshare.launch_server``, the LangGraph graph with each node
  passing the hand-written ``kvshare`` annotation (method kvcmas).

Every server first runs ``--warmup`` workflows of each app (KVCMAS's anchor pools fill; not
recorded), then ``--workflows`` measured ones. TTFT is LangChain's callback time from the model
call to its first streamed token (LangGraph), or AutoGen's event time from the previous agent's
message to this agent's first streamed chunk. "Later" agents are every agent after the first.
Reuse is, over the measured workflows, the tokens injected or corrected from a source divided by
the tokens of shared segments that had a source (``kvshare_injected_tokens_total`` /
``kvshare_sourced_tokens_total`` on ``/metrics``).

    python -m benchmarks.agent_apps                  # 8 warm-up + 6 measured workflows per app
    python -m benchmarks.agent_apps --quick          # 2 + 2, 400-word reports (plumbing check)

Writes ``results/agent_apps.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

from tests.integration.server import Server, agents_python, stock_server
from tests.integration.workflow_helpers import scrape_metrics

ROOT = Path(__file__).resolve().parents[1]
APPS = {"langgraph": "langgraph_agents.py", "autogen": "autogen_team.py"}
# server -> (how it starts, the apps it runs and their extra flags)
SETUPS = {
    "plain": {"apps": {"langgraph": [], "autogen": []}},
    "auto": {"flags": ["--kvshare-auto", "kvcmas"], "apps": {"langgraph": [], "autogen": []}},
    "annotated": {"flags": [], "apps": {"langgraph": ["--annotate", "kvcmas"]}},
}


def start(name: str, log_dir: Path) -> Server:
    if name == "plain":
        from sglang_kvshare.assets import ensure_default_model

        return stock_server(ensure_default_model(), log_dir / "plain.log", timeout=900)
    return Server(["-m", "sglang_kvshare.launch_server", "--enable-metrics", *SETUPS[name]["flags"]],
                  log_dir / f"{name}.log", timeout=900)


def run_app(python: str, app: str, server: Server, flags: list[str], seeds: range, words: int,
            max_tokens: int, bar) -> list[dict]:
    """Workflows ``seeds`` of ``app``, one after another (one JSON line each)."""
    cmd = [python, str(ROOT / "examples" / APPS[app]), "--base-url", server.url + "/v1", "--first-seed",
           str(seeds.start), "--workflows", str(len(seeds)), "--words", str(words), "--max-tokens", str(max_tokens),
           *flags]
    out = []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) as proc:
        for line in proc.stdout:
            out.append(json.loads(line))
            bar.update()
    if proc.returncode != 0:
        raise RuntimeError(f"{app} exited with {proc.returncode}")
    return out


def summarise(runs: list[dict]) -> dict:
    first = [r["agents"][0]["ttft_s"] for r in runs]
    later = [a["ttft_s"] for r in runs for a in r["agents"][1:]]
    return {"workflows": len(runs), "first_ttft_p50_s": statistics.median(first),
            "later_ttft_p50_s": statistics.median(later), "later_ttft_s": later}


def measure(args, log_dir: Path, python: str) -> dict:
    total = sum(len(s["apps"]) for s in SETUPS.values()) * (args.warmup + args.workflows)
    results: dict = {}
    with tqdm(total=total, unit="workflow") as bar:
        for name, setup in SETUPS.items():
            bar.set_description(f"{name}: starting server")
            server = start(name, log_dir)
            try:
                for app, flags in setup["apps"].items():
                    bar.set_description(f"{name} {app} warm-up")
                    run_app(python, app, server, flags, range(10_000, 10_000 + args.warmup), args.words,
                            args.max_tokens, bar)
                    before = scrape_metrics(server) if name != "plain" else {}
                    bar.set_description(f"{name} {app}")
                    runs = run_app(python, app, server, flags, range(args.workflows), args.words, args.max_tokens, bar)
                    res = summarise(runs)
                    if name != "plain":
                        after = scrape_metrics(server)

                        def grew(metric):
                            key = (metric, (("method", "kvcmas"),))
                            return after.get(key, 0.0) - before.get(key, 0.0)

                        res.update(sourced_tokens=grew("kvshare_sourced_tokens_total"),
                                   injected_tokens=grew("kvshare_injected_tokens_total"))
                        res["reuse"] = res["injected_tokens"] / res["sourced_tokens"] if res["sourced_tokens"] else 0.0
                    res["answers"] = [[a["answer"] for a in r["agents"]] for r in runs[:2]]
                    results.setdefault(app, {})[name] = res
            finally:
                server.stop()
    for app, by in results.items():
        base = by["plain"]["later_ttft_p50_s"]
        for name, res in by.items():
            res["later_ttft_vs_plain"] = res["later_ttft_p50_s"] / base
        if "annotated" in by:
            by["auto"]["later_ttft_vs_annotated"] = by["auto"]["later_ttft_p50_s"] / by["annotated"]["later_ttft_p50_s"]
    return results


def markdown(results: dict, args) -> str:
    lines = [f"Reports of {args.words} words (~{round(args.words * 1.8, -2):.0f} tokens, SmolLM2 tokenizer), "
             f"{args.warmup} warm-up + {args.workflows} measured workflows per app and server, "
             f"max_tokens {args.max_tokens}; {platform.processor() or platform.machine()}, CPU.", "",
             "| app | server | first-agent TTFT p50 s | later-agent TTFT p50 s | vs plain | vs annotated | reuse |",
             "|---|---|---|---|---|---|---|"]
    for app, by in results.items():
        for name, r in by.items():
            vs_ann = f"{r['later_ttft_vs_annotated']:.2f}x" if "later_ttft_vs_annotated" in r else ""
            reuse = f"{r['reuse']:.2f}" if "reuse" in r else ""
            lines.append(f"| {app} | {name} | {r['first_ttft_p50_s']:.2f} | {r['later_ttft_p50_s']:.2f} | "
                         f"{r['later_ttft_vs_plain']:.2f}x | {vs_ann} | {reuse} |")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 4), squeeze=False)
    for ax, (app, by) in zip(axes[0], results.items()):
        names = list(by)
        ax.boxplot([by[n]["later_ttft_s"] for n in names], tick_labels=names)
        ax.set_title(f"{app}: later-agent TTFT")
        ax.set_ylabel("seconds")
        ax.set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--workflows", type=int, default=6)
    p.add_argument("--words", type=int, default=1100)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--quick", action="store_true", help="2 + 2 workflows, 400-word reports")
    p.add_argument("--out", default=str(ROOT / "results" / "agent_apps"))
    args = p.parse_args(argv)
    if args.quick:
        args.warmup, args.workflows, args.words = 2, 2, 400
    python = agents_python()
    t0 = time.time()
    with tempfile.TemporaryDirectory() as d:
        results = measure(args, Path(d), python)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"argv": vars(args), "seconds": round(time.time() - t0, 1)}
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    table = markdown(results, args)
    out.with_suffix(".md").write_text(table)
    plot(results, out.with_suffix(".png"))
    print(table)


if __name__ == "__main__":
    main()
