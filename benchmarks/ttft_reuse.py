"""Reuse must pay off on the CPU too: time-to-first-token of a reused agent, fullshared vs nonshared.

Each measurement is one fresh two-agent workflow on a real server (``python -m
sglang_kvshare.launch_server`` with no ``--model-path``: SmolLM2-135M-Instruct, float32, CPU).
Agent 1 ("solver") and agent 2 ("critic", another system prompt, so its question sits at another
position) both read the same shared question segment (slot ``q``) of N tokens:

- ``fullshared``: agent 2's question KV is injected from agent 1's cache (RoPE re-aligned); it
  computes only its private tokens (system prompt and chat template).
- ``nonshared``: agent 2 prefills its whole prompt.

TTFT is the client-side wall time of a non-streamed ``/generate`` with ``max_new_tokens=1`` on
127.0.0.1 (HTTP, tokenisation, scheduling, prefill/injection and sampling of one token). Agent 1's
turn (a full prefill under either method) is timed too and reported as "first agent"; only agent
2's TTFT is the "reused" figure, and the speed-up is nonshared / fullshared of its medians. Every
repetition uses new workflow ids, so nothing carries over between repetitions (radix caches are
namespaced per workflow and agent).

The same is measured on a second server with SGLang's stock ``--attention-backend torch_native``
instead of our ``kvshare_torch``: the stock extend pads the queries to the whole sequence, so
agent 2's short extend after N injected tokens still costs attention over N x N (measured ~6.3 s
for a 1-token extend after 4K tokens, i.e. ~1.6 s after 2K), which is what our backend removes.
``--no-stock`` skips it.

    python -m benchmarks.ttft_reuse                 # N = 1024, 2048; 3 repetitions
    python -m benchmarks.ttft_reuse --quick         # N = 256, 512; 2 repetitions
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from tqdm import tqdm

from sglang_kvshare.testing.server import Server
from sglang_kvshare.testing.workflows import payload, private_tokens, segments

METHODS = ("fullshared", "nonshared")
BACKENDS = {"kvshare_torch": [], "torch_native": ["--attention-backend", "torch_native"]}
FIRST, REUSED = "solver", "critic"


def build_question(tok, n_tokens: int) -> str:
    """A question of numbered facts whose tokenisation (as the server does it) has n_tokens (rarely one more)."""
    facts, i = [], 0
    while len(tok.encode(" ".join(facts), add_special_tokens=False)) < n_tokens + 16:
        facts += [f"Fact {j}: box {j} holds {3 * j} red apples and {j + 2} green pears." for j in range(i, i + 32)]
        i += 32
    ids = tok.encode("Question: " + " ".join(facts), add_special_tokens=False)
    tail = " How many red apples are in box 5?"
    cut = n_tokens - len(tok.encode(tail, add_special_tokens=False))
    while len(tok.encode(text := tok.decode(ids[:cut]) + tail, add_special_tokens=False)) < n_tokens:
        cut += 1  # a token can merge across the seam: grow until the count is reached
    return text


def timed(server: Server, body: dict) -> tuple[float, dict]:
    t0 = time.perf_counter()
    r = server.generate(body, timeout=1800)
    dt = time.perf_counter() - t0
    if r.status_code != 200:
        raise RuntimeError(f"HTTP {r.status_code}: {r.text}")
    return dt, r.json()["meta_info"]


def one_workflow(server: Server, method: str, question: str, tag: str) -> dict:
    """Agent 1 then agent 2 of a fresh workflow; both with max_new_tokens=1."""
    wf = f"{tag}-{uuid.uuid4().hex[:8]}"
    first_s, _ = timed(server, payload(wf, FIRST, method, segments(FIRST, {}, question=question), 1))
    reused_s, info = timed(server, payload(wf, REUSED, method, segments(REUSED, {}, question=question), 1))
    meta = info["kvshare"]
    q = meta["segments"][1]
    expected = q["tokens"] if method == "fullshared" else 0
    if q.get("injected_tokens", 0) != expected or meta["computed_tokens"] != meta["prompt_tokens"] - expected:
        raise RuntimeError(f"{method}: unexpected reuse in {wf}: {meta}")
    return {
        "first_s": first_s,
        "reused_s": reused_s,
        "reused_server_e2e_s": info.get("e2e_latency"),
        "shared_tokens": q["tokens"],
        "private_tokens": private_tokens(meta),
        "prompt_tokens": meta["prompt_tokens"],
        "computed_tokens": meta["computed_tokens"],
    }


def summarise(samples: list[dict]) -> dict:
    first = [s["first_s"] for s in samples]
    reused = [s["reused_s"] for s in samples]
    keys = ("shared_tokens", "private_tokens", "prompt_tokens", "computed_tokens")
    return {
        "reused_ttft_s": {"median": statistics.median(reused), "samples": reused},
        "first_agent_ttft_s": {"median": statistics.median(first), "samples": first},
        "reused_server_e2e_s": [s["reused_server_e2e_s"] for s in samples],
        **{k: samples[0][k] for k in keys},
    }


def run_backend(name: str, flags: list[str], questions: dict[int, str], reps: int, log_dir: Path, bar) -> dict:
    bar.set_description(f"{name}: starting server")
    server = Server(["-m", "sglang_kvshare.launch_server", *flags], log_dir / f"{name}.log", timeout=900)
    try:
        for method in METHODS:  # warm-up, not recorded
            one_workflow(server, method, questions[min(questions)][:400], f"warmup-{name}")
        samples = {(n, m): [] for n in questions for m in METHODS}
        for rep in range(reps):
            for n, question in questions.items():
                for method in METHODS:
                    bar.set_description(f"{name} N={n} {method} rep {rep + 1}")
                    samples[n, method].append(one_workflow(server, method, question, f"{name}-{method}-n{n}-r{rep}"))
                    bar.update()
    finally:
        server.stop()
    out = {}
    for n in questions:
        res = {m: summarise(samples[n, m]) for m in METHODS}
        res["speedup"] = res["nonshared"]["reused_ttft_s"]["median"] / res["fullshared"]["reused_ttft_s"]["median"]
        out[str(n)] = res
    return out


def markdown(results: dict) -> str:
    lines = [
        "| backend | N shared | method | private tok | computed tok | first agent TTFT s | reused TTFT s (median) | speed-up |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for backend, per_n in results["backends"].items():
        for n, res in per_n.items():
            for m in METHODS:
                r = res[m]
                speed = f"**{res['speedup']:.1f}x**" if m == "fullshared" else ""
                lines.append(
                    f"| {backend} | {r['shared_tokens']} | {m} | {r['private_tokens']} | {r['computed_tokens']} "
                    f"| {r['first_agent_ttft_s']['median']:.2f} | {r['reused_ttft_s']['median']:.3f} | {speed} |"
                )
    for n, ratio in results.get("backend_speedup_fullshared", {}).items():
        lines.append(f"\nfullshared reused TTFT at N={n}: torch_native / kvshare_torch = **{ratio:.1f}x**")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    """Grouped bars of agent 2's median TTFT per N (min-max whiskers); speed-up above fullshared."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FormatStrFormatter

    configs = [(b, m) for b in results["backends"] for m in METHODS]
    ns = list(next(iter(results["backends"].values())))
    width = 0.8 / len(configs)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, (b, m) in enumerate(configs):
        xs = [j + (i - (len(configs) - 1) / 2) * width for j in range(len(ns))]
        samples = [results["backends"][b][n][m]["reused_ttft_s"]["samples"] for n in ns]
        meds = [results["backends"][b][n][m]["reused_ttft_s"]["median"] for n in ns]
        err = [[med - min(s) for med, s in zip(meds, samples)], [max(s) - med for med, s in zip(meds, samples)]]
        ax.bar(
            xs,
            meds,
            width,
            yerr=err,
            capsize=3,
            label=f"{m} ({b})",
            color=f"C{METHODS.index(m)}",
            hatch="" if b == "kvshare_torch" else "//",
            edgecolor="black",
            linewidth=0.5,
        )
        if m == "fullshared":
            for x, s, n in zip(xs, samples, ns):
                ax.annotate(
                    f"{results['backends'][b][n]['speedup']:.1f}x",
                    (x, max(s)),
                    xytext=(0, 4),
                    textcoords="offset points",
                    ha="center",
                    fontsize=9,
                    fontweight="bold",
                )
    ax.set_xticks(range(len(ns)), [f"N={n} shared tokens" for n in ns])
    ax.set_yscale("log")
    for axis_fmt in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
        axis_fmt(FormatStrFormatter("%g"))
    ax.set_ylabel("agent 2 TTFT, s (median, min-max)")
    ax.set_title("Reused agent TTFT, SmolLM2-135M float32 CPU\n(bold: speed-up nonshared / fullshared)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-tokens", default="1024,2048", help="comma-separated shared question lengths")
    ap.add_argument("--reps", type=int, default=3, help="repetitions per (backend, N, method)")
    ap.add_argument("--quick", action="store_true", help="smoke run: N=256,512 and 2 repetitions")
    ap.add_argument("--no-stock", action="store_true", help="skip the stock torch_native server")
    ap.add_argument("--out", type=Path, default=Path("results/ttft_reuse.json"))
    ap.add_argument("--replot", action="store_true", help="only redraw the plot and table from --out")
    args = ap.parse_args(argv)
    if args.replot:
        results = json.loads(args.out.read_text())
        plot(results, args.out.with_suffix(".png"))
        print(markdown(results))
        return
    ns = [256, 512] if args.quick else [int(x) for x in args.n_tokens.split(",")]
    reps = 2 if args.quick else args.reps

    from transformers import AutoTokenizer

    from sglang_kvshare.assets import ensure_default_model

    model = ensure_default_model()
    tok = AutoTokenizer.from_pretrained(model)
    questions = {n: build_question(tok, n) for n in sorted(ns)}
    backends = {k: v for k, v in BACKENDS.items() if not (args.no_stock and k == "torch_native")}
    log_dir = Path(tempfile.mkdtemp(prefix="ttft_reuse-"))
    t0 = time.time()
    with tqdm(total=len(backends) * len(ns) * len(METHODS) * reps, unit="wf") as bar:
        per_backend = {b: run_backend(b, f, questions, reps, log_dir, bar) for b, f in backends.items()}
    results = {
        "benchmark": "ttft_reuse",
        "ttft": "client wall time of a non-streamed /generate with max_new_tokens=1 (127.0.0.1)",
        "model": model,
        "agents": {"first": FIRST, "reused": REUSED},
        "reps": reps,
        "host": {"machine": platform.machine(), "processor": platform.processor(), "python": platform.python_version()},
        "wall_s": time.time() - t0,
        "backends": per_backend,
    }
    if "torch_native" in per_backend:
        results["backend_speedup_fullshared"] = {
            n: per_backend["torch_native"][n]["fullshared"]["reused_ttft_s"]["median"]
            / per_backend["kvshare_torch"][n]["fullshared"]["reused_ttft_s"]["median"]
            for n in per_backend["kvshare_torch"]
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    plot(results, args.out.with_suffix(".png"))
    print(markdown(results))
    print(f"\nwrote {args.out} and {args.out.with_suffix('.png')} (server logs: {log_dir})")


if __name__ == "__main__":
    main()
