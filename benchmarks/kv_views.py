"""One copy of a shared context: KV views against copy mode, side by side in one run.

One server (``python -m sglang_kvshare.launch_server``, the default SmolLM2 on the CPU, default
flags: views on) runs each workflow twice, in views mode and in copy mode (``kv_views: false`` in
the annotation: every later agent writes a re-rotated copy of each shared segment into slots of
its own, as ``--no-kvshare-kv-views`` does), alternating which mode goes first, so drift of the
machine hits both alike. A workflow is sequential ``fullshared`` agents: agent i reads the
workflow's shared context (distinct per workflow, ``benchmarks.serving.workload.make_context``) and every
earlier agent's output, greedy, ``--output-len`` tokens each (ignore_eos). Before each workflow
the radix tree is flushed, so ``tree_tokens`` after it (``/server_info``) is the KV one finished
workflow leaves.

Reported per mode, then views / copy: KV tokens the tree holds per workflow, the scheduler's
injection time per later agent (``meta_info.kvshare.inject_ms``), later agents' TTFT and decode
tokens/s (streamed), the first agent's decode tokens/s (no view in either mode: the noise
floor), and whether every greedy output equals the other mode's.

``--method kvcmas``: the agents are KVCMAS agents. An accepted correction is then kept as a view
plus a rank ``--kvshare-leaf-rank`` KV leaf (``leaf_bytes``; the requests ask for leaves,
``leaves: true``, whatever ``--kvshare-leaf-policy`` decides), against a corrected copy in copy
mode (the corrected rows' K/V bytes); the scheduler time is the correction's (gather, gate,
delta, then the leaf or the copy: ``correction_ms``). ``--warmup`` workflows first fill the
anchor pools (their dense fallbacks), in both modes alternately. Greedy outputs then differ
where the leaf's truncation moves a token; ``benchmarks.fidelity`` measures what that costs.

    python -m benchmarks.kv_views                     # 2K context, 4 agents, 6 workflows (+1 warm-up)
    python -m benchmarks.kv_views --context 512 --workflows 2   # a quick look
    python -m benchmarks.kv_views --method kvcmas --warmup 8 --out results/kv_leaves.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import requests
from tqdm import tqdm

from benchmarks.client import stream_generate
from benchmarks.serving.workload import make_context
from sglang_kvshare.routing import routing_headers
from sglang_kvshare.testing.server import Server
from sglang_kvshare.testing.workflows import flush_cache, payload, segments, settle

AGENTS = {
    "planner": "You are the planner. Split the task into steps.",
    "solver": "You are a careful solver. Think step by step.",
    "critic": "You are a strict critic who checks every claim of the solver.",
    "final": "You read the analyses and give the final answer only.",
}


def workflow(
    server: Server,
    session: requests.Session,
    context: str,
    wf: str,
    agents: list[str],
    output_len: int,
    views: bool,
    method: str = "fullshared",
) -> dict:
    flush_cache(server)
    outputs, turns = {}, []
    for agent in agents:
        body = payload(
            wf,
            agent,
            method,
            segments(agent, outputs, AGENTS[agent], question=context),
            output_len,
            kv_views=views,
            leaves=views,
        )
        body["sampling_params"]["ignore_eos"] = True
        r = stream_generate(session, server.url, body, timeout=1800, headers=routing_headers(body))
        meta = r.meta
        n = meta.get("completion_tokens", output_len)
        turns.append(
            {
                "agent": agent,
                "text": r.text,
                "ttft_s": r.ttft_s,
                "decode_tok_s": (n - 1) / max(r.e2e_s - r.ttft_s, 1e-9),
                "inject_ms": meta["kvshare"].get("inject_ms"),
                "view_tokens": meta["kvshare"]["view_tokens"],
                "injected_tokens": meta["kvshare"]["injected_tokens"],
                "prompt_tokens": meta["kvshare"]["prompt_tokens"],
                **_correction(meta["kvshare"]),
            }
        )
        outputs[agent] = r.text
    return {"turns": turns, "tree_tokens": settle(server)["tree_tokens"]}


def _correction(kv: dict) -> dict:
    """A turn's corrections: scheduler time, corrected rows and their bytes as a copy, leaf
    bytes, and the modes of its shared segments."""
    segs = [s for s in kv["segments"] if "corrected_rows" in s]
    rows = sum(s["corrected_rows"] for s in segs if s["mode"] == "corrected")
    return {
        "correction_ms": kv.get("correction_ms", 0.0),
        "corrected_rows": rows,
        "copy_bytes": rows * kv.get("kv_bytes_per_token", 0),
        "leaf_bytes": sum(s.get("leaf_bytes", 0) for s in segs),
        "modes": [s["mode"] for s in segs],
    }


def run_modes(
    contexts: list[str],
    agents: list[str],
    output_len: int,
    log_dir: Path,
    bar,
    method: str = "fullshared",
    warmup: int = 1,
) -> dict:
    """mode ("on", "off") -> the measured workflows (the first ``warmup`` contexts warm the
    engine, and a correction method's anchor pools, up)."""
    bar.set_description("starting the server")
    server = Server(["-m", "sglang_kvshare.launch_server"], log_dir / "server.log", timeout=900)
    runs: dict = {"on": [], "off": []}
    try:
        with requests.Session() as session:
            for k, context in enumerate(contexts):
                for mode in ("on", "off") if k % 2 == 0 else ("off", "on"):
                    bar.set_description(
                        f"workflow {k + 1}/{len(contexts)}, views {mode}" + (" (warm-up)" if k < warmup else "")
                    )
                    run = workflow(
                        server, session, context, f"views-{mode}-{k}", agents, output_len, mode == "on", method
                    )
                    if k >= warmup:
                        runs[mode].append(run)
                    bar.update()
    finally:
        server.stop()
    return runs


def summarise(runs: list[dict]) -> dict:
    later = [t for r in runs for t in r["turns"][1:]]
    med = statistics.median
    return {
        "tree_tokens_per_workflow": med(r["tree_tokens"] for r in runs),
        "inject_ms_per_later_agent": med(t["inject_ms"] or 0.0 for t in later),
        "later_ttft_s": med(t["ttft_s"] for t in later),
        "later_decode_tok_s": med(t["decode_tok_s"] for t in later),
        "first_decode_tok_s": med(r["turns"][0]["decode_tok_s"] for r in runs),
        "view_tokens_per_workflow": med(sum(t["view_tokens"] for t in r["turns"]) for r in runs),
        "injected_tokens_per_workflow": med(sum(t["injected_tokens"] for t in r["turns"]) for r in runs),
        "correction_ms_per_later_agent": med(t["correction_ms"] for t in later),
        "corrected_later_agents": sum(t["corrected_rows"] > 0 for t in later),
        "later_agents": len(later),
        "correction_bytes_per_corrected_agent": med(
            [t["leaf_bytes"] or t["copy_bytes"] for t in later if t["corrected_rows"]] or [0]
        ),
    }


def markdown(res: dict) -> str:
    s, rows = (
        res["summary"],
        [
            ("KV tokens the tree holds per finished workflow", "tree_tokens_per_workflow", "{:.0f}"),
            ("tokens read through a view per workflow", "view_tokens_per_workflow", "{:.0f}"),
            ("injection time per later agent, ms (scheduler)", "inject_ms_per_later_agent", "{:.2f}"),
            ("later-agent TTFT, s", "later_ttft_s", "{:.3f}"),
            ("later-agent decode, tokens/s", "later_decode_tok_s", "{:.1f}"),
            ("first-agent decode, tokens/s (no view in either mode)", "first_decode_tok_s", "{:.1f}"),
        ],
    )
    if res["config"].get("method", "fullshared") != "fullshared":
        rows[2] = ("correction time per later agent, ms (scheduler)", "correction_ms_per_later_agent", "{:.1f}")
        rows += [
            (
                "bytes of a corrected agent's correction (leaf / corrected copy)",
                "correction_bytes_per_corrected_agent",
                "{:.0f}",
            ),
            ("later agents with an accepted correction", "corrected_later_agents", "{:.0f}"),
        ]
    lines = [
        f"KV views vs copy mode: {res['config']}",
        "",
        "| median | views on | copy mode | views / copy |",
        "|---|---:|---:|---:|",
    ]
    for label, key, fmt in rows:
        on, off = s["on"][key], s["off"][key]
        ratio = f"{on / off:.3f}" if off else "-"
        lines.append(f"| {label} | {fmt.format(on)} | {fmt.format(off)} | {ratio} |")
    lines += ["", f"greedy outputs identical in both modes: {res['identical_outputs']} of {res['outputs']}"]
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=2048, help="shared context tokens")
    ap.add_argument("--agents", type=int, default=4, choices=range(2, len(AGENTS) + 1))
    ap.add_argument("--workflows", type=int, default=6, help="measured workflows per mode (one more warms up)")
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--method", default="fullshared", choices=["fullshared", "kvcmas"])
    ap.add_argument("--warmup", type=int, default=1, help="warm-up workflows per mode")
    ap.add_argument("--out", type=Path, default=Path("results/kv_views.json"))
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    from sglang_kvshare.assets import ensure_default_model

    tok = AutoTokenizer.from_pretrained(ensure_default_model())
    contexts = [make_context(tok, args.context, f"views-{k}") for k in range(args.workflows + args.warmup)]
    agents = list(AGENTS)[-args.agents :]
    t0 = time.time()
    with tempfile.TemporaryDirectory() as logs, tqdm(total=2 * len(contexts)) as bar:
        runs = run_modes(contexts, agents, args.output_len, Path(logs), bar, args.method, args.warmup)
    texts = {m: [t["text"] for r in runs[m] for t in r["turns"]] for m in runs}
    res = {
        "config": {**vars(args), "out": str(args.out), "machine": platform.platform(), "minutes": None},
        "summary": {m: summarise(runs[m]) for m in runs},
        "identical_outputs": sum(a == b for a, b in zip(texts["on"], texts["off"])),
        "outputs": len(texts["on"]),
        "runs": runs,
    }
    res["config"]["minutes"] = round((time.time() - t0) / 60, 1)
    save(args.out, res, markdown(res))


def save(out: Path, res: dict, table: str) -> None:
    """``res`` as JSON in ``out``, ``table`` beside it (``.md``) and on stdout."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    out.with_suffix(".md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
