"""Unmodified agent apps: later-agent time to first token on stock SGLang and with automatic
detection (``--kvshare-auto kvcmas`` and ``fullshared``), measured side by side in one run.

The apps are the real frameworks, run unchanged in their own venv (``scripts/setup.sh``), each
workflow with its own ~2K-token report (distinct contexts):

- ``langgraph`` (``examples/langgraph_agents.py``): a LangGraph graph solver -> critic -> final,
  the report and the earlier answers as messages of their own;
- ``autogen`` (``examples/autogen_team.py``): an AutoGen round-robin team;
- ``crewai`` (``examples/crewai_crew.py``): a CrewAI sequential crew, the report in every task's
  description and the earlier answers pasted in by ``context=[...]`` (one API key per crew, no
  header);
- ``chain`` (``examples/langchain_templates.py --app chain``): a ``ChatPromptTemplate`` chain whose
  user templates embed the report and the earlier answers;
- ``rag`` (``--app rag``): two agents that get the report's 8 chunks, the second in another order.

Servers (one at a time, each fresh, the real default model SmolLM2-135M-Instruct on the CPU):
``plain`` is stock SGLang (``SGLANG_PLUGINS=none``); ``kvcmas`` and ``fullshared`` are
``python -m sglang_kvshare.launch_server --kvshare-auto METHOD``, default flags otherwise;
``annotated`` runs the LangGraph graph with the hand-written ``kvshare`` annotation (kvcmas).

Every server first runs ``--warmup`` workflows of each app (KVCMAS's anchor pools fill; stock: 2),
then ``--workflows`` measured ones. TTFT is each app's own measure (LangChain's callbacks, AutoGen's
events, CrewAI's LLM events) from the model call to its first streamed token. "Later" calls are
every agent after the first. Over the measured workflows (``/metrics``): reuse = tokens injected
or corrected from a source / prompt tokens of later calls; accepted = injected / detected tokens.

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

from sglang_kvshare.testing.server import Server, agents_python, stock_server
from sglang_kvshare.testing.workflows import scrape_metrics

ROOT = Path(__file__).resolve().parents[1]
APPS = {
    "langgraph": ["langgraph_agents.py"],
    "autogen": ["autogen_team.py"],
    "crewai": ["crewai_crew.py"],
    "chain": ["langchain_templates.py", "--app", "chain"],
    "rag": ["langchain_templates.py", "--app", "rag"],
}
# server -> how it starts, the apps it runs (their extra flags); the method its metrics carry
SETUPS = {
    "plain": {"apps": {app: [] for app in APPS}},
    "kvcmas": {"flags": ["--kvshare-auto", "kvcmas"], "apps": {app: [] for app in APPS}, "method": "kvcmas"},
    "fullshared": {
        "flags": ["--kvshare-auto", "fullshared"],
        "apps": {app: [] for app in APPS},
        "method": "fullshared",
    },
    "annotated": {"flags": [], "apps": {"langgraph": ["--annotate", "kvcmas"]}, "method": "kvcmas"},
}


def start(name: str, log_dir: Path) -> Server:
    if name == "plain":
        from sglang_kvshare.assets import ensure_default_model

        return stock_server(ensure_default_model(), log_dir / "plain.log", timeout=900)
    return Server(
        ["-m", "sglang_kvshare.launch_server", "--enable-metrics", *SETUPS[name]["flags"]],
        log_dir / f"{name}.log",
        timeout=900,
    )


def run_app(
    python: str, app: str, server: Server, flags: list[str], seeds: range, words: int, max_tokens: int, bar
) -> list[dict]:
    """Workflows ``seeds`` of ``app``, one after another (one JSON line each)."""
    script, *app_flags = APPS[app]
    cmd = [
        python,
        str(ROOT / "examples" / script),
        *app_flags,
        "--base-url",
        server.url + "/v1",
        "--first-seed",
        str(seeds.start),
        "--workflows",
        str(len(seeds)),
        "--words",
        str(words),
        "--max-tokens",
        str(max_tokens),
        *flags,
    ]
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
    return {
        "workflows": len(runs),
        "first_ttft_p50_s": statistics.median(first),
        "later_ttft_p50_s": statistics.median(later),
        "later_ttft_s": later,
    }


def counters(server: Server, method: str) -> dict:
    """The ``kvshare_*`` counters the summary reads (a snapshot)."""
    m = scrape_metrics(server)
    return {
        "injected": m.get(("kvshare_injected_tokens_total", (("method", method),)), 0.0),
        "later_prompt": m.get(("kvshare_auto_prompt_tokens_total", (("turn", "later"),)), 0.0),
        "detected": sum(m.get(("kvshare_detected_tokens_total", (("kind", k),)), 0.0) for k in ("prompt", "output")),
        "detect_s": m.get(("kvshare_detect_seconds_sum", ()), 0.0),
        "detect_n": m.get(("kvshare_detect_seconds_count", ()), 0.0),
    }


def measure(args, log_dir: Path, python: str) -> dict:
    setups = {
        n: dict(s, apps={a: f for a, f in s["apps"].items() if a in args.apps})
        for n, s in SETUPS.items()
        if n in args.servers
    }
    setups = {n: s for n, s in setups.items() if s["apps"]}
    total = sum(len(s["apps"]) * (warmups(args, n) + args.workflows) for n, s in setups.items())
    results: dict = {}
    with tqdm(total=total, unit="workflow") as bar:
        for name, setup in setups.items():
            bar.set_description(f"{name}: starting server")
            server = start(name, log_dir)
            try:
                for app, flags in setup["apps"].items():
                    bar.set_description(f"{name} {app} warm-up")
                    run_app(
                        python,
                        app,
                        server,
                        flags,
                        range(10_000, 10_000 + warmups(args, name)),
                        args.words,
                        args.max_tokens,
                        bar,
                    )
                    method = setup.get("method")
                    before = counters(server, method) if method else {}
                    bar.set_description(f"{name} {app}")
                    runs = run_app(python, app, server, flags, range(args.workflows), args.words, args.max_tokens, bar)
                    res = summarise(runs)
                    if method:
                        after = counters(server, method)
                        grew = {k: after[k] - before[k] for k in after}
                        res["counters"] = grew
                        if grew["later_prompt"]:
                            res["reuse"] = grew["injected"] / grew["later_prompt"]
                            res["accepted"] = grew["injected"] / grew["detected"] if grew["detected"] else 0.0
                            res["detect_ms_mean"] = 1000 * grew["detect_s"] / grew["detect_n"]
                    res["answers"] = [[a["answer"] for a in r["agents"]] for r in runs[:2]]
                    results.setdefault(app, {})[name] = res
            finally:
                server.stop()
    for app, by in results.items():
        base = by["plain"]["later_ttft_p50_s"] if "plain" in by else None
        for name, res in by.items():
            if base:
                res["later_ttft_vs_plain"] = res["later_ttft_p50_s"] / base
    return results


def warmups(args, name: str) -> int:
    return min(args.warmup, 2) if name == "plain" else args.warmup


def markdown(results: dict, args) -> str:
    lines = [
        f"Reports of {args.words} words (~{round(args.words * 1.8, -2):.0f} tokens, SmolLM2 tokenizer), "
        f"{args.warmup} warm-up (stock: {min(args.warmup, 2)}) + {args.workflows} measured workflows per app "
        f"and server, max_tokens {args.max_tokens}; {platform.processor() or platform.machine()}, CPU.",
        "",
        "| app | server | first-agent TTFT p50 s | later-agent TTFT p50 s | vs plain | reuse | accepted |"
        " detection ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for app, by in results.items():
        for name, r in by.items():
            vs = f"{r['later_ttft_vs_plain']:.2f}x" if "later_ttft_vs_plain" in r else ""
            extra = [f"{r[k]:.2f}" if k in r else "" for k in ("reuse", "accepted", "detect_ms_mean")]
            lines.append(
                f"| {app} | {name} | {r['first_ttft_p50_s']:.2f} | {r['later_ttft_p50_s']:.2f} | {vs} | "
                + " | ".join(extra)
                + " |"
            )
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
    p.add_argument("--apps", nargs="+", choices=list(APPS), default=list(APPS))
    p.add_argument("--servers", nargs="+", choices=list(SETUPS), default=list(SETUPS))
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
