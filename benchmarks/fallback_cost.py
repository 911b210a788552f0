"""What a rejected later turn costs against not sharing, side by side on one server.

One server (``python -m sglang_kvshare.launch_server``, the default SmolLM2 on the CPU, default
flags) runs two-agent workflows on distinct contexts (``benchmarks.serving.workload.make_context``): the
first agent prefills the context, the second reads it and the first agent's output. The second
agent's turn is measured in four arms, each on a context of its own:

- ``nonshared``: the whole prompt prefilled;
- ``kvcmas+dense, tau 0``: the gate is made to reject every segment (annotation ``tau: 0``), which
  is then prefilled densely (the papers' fallback);
- ``kvcmas, tau 0``: the same with the default partial fallback (every block rejected too, so the
  segment is prefilled densely as well);
- ``kvcmas``: the default gate (cold pools early on: ``few_anchors`` rejections).

The arms alternate their order from one context to the next, and the server finishes every
anchor observation (factorised beside the scheduler) before each workflow, so a turn pays only
for itself. Reported per arm: the later agent's TTFT (median, max) and its ratio to
nonshared's, the gates and the tokens computed.

    python -m benchmarks.fallback_cost                       # 4K, 3 contexts per arm (~6 min)
    python -m benchmarks.fallback_cost --context 2048 --contexts 2
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import requests
from tqdm import tqdm

from benchmarks.kv_views import save
from benchmarks.client import stream_generate
from benchmarks.serving.workload import make_context
from sglang_kvshare.routing import routing_headers
from sglang_kvshare.testing.server import Server
from sglang_kvshare.testing.workflows import payload, segments, settle

AGENTS = ("solver", "critic")  # their system prompts: ``sglang_kvshare.testing.workflows.SYSTEM``
ARMS = {  # arm -> (method, annotation keys of the later agent)
    "nonshared": ("nonshared", {}),
    "kvcmas+dense, tau 0": ("kvcmas", {"tau": 0.0, "fallback": "dense"}),
    "kvcmas, tau 0": ("kvcmas", {"tau": 0.0}),
    "kvcmas": ("kvcmas", {}),
}


def later_turn(server: Server, session: requests.Session, context: str, wf: str, arm: str, output_len: int) -> dict:
    """Run the workflow; the second agent's measurements."""
    method, extra = ARMS[arm]
    outputs: dict = {}
    for agent in AGENTS:
        body = payload(
            wf, agent, method, segments(agent, outputs, question=context), output_len, **(extra if outputs else {})
        )
        body["sampling_params"]["ignore_eos"] = True
        r = stream_generate(session, server.url, body, timeout=1800, headers=routing_headers(body))
        outputs[agent] = r.text
    kv = r.meta["kvshare"]
    return {
        "ttft_s": r.ttft_s,
        "computed_tokens": kv["computed_tokens"],
        "prompt_tokens": kv["prompt_tokens"],
        "gates": [s.get("gate") for s in kv.get("segments", []) if "gate" in s],
        "recomputed_rows": kv.get("recomputed_rows", 0),
    }


def summarise(turns: dict) -> dict:
    med, top = statistics.median, max
    base = [t["ttft_s"] for t in turns["nonshared"]]
    out = {}
    for arm, ts in turns.items():
        ttft = [t["ttft_s"] for t in ts]
        out[arm] = {
            "ttft_median_s": round(med(ttft), 3),
            "ttft_max_s": round(top(ttft), 3),
            "vs_nonshared": round(med(ttft) / med(base), 3),
            "max_vs_nonshared_max": round(top(ttft) / top(base), 3),
            "computed_tokens": med(t["computed_tokens"] for t in ts),
            "gates": [g for t in ts for g in t["gates"]],
        }
    return out


def markdown(res: dict) -> str:
    lines = [
        f"Later-agent TTFT by arm: {res['config']}",
        "",
        "| arm | TTFT median s | vs nonshared | max s | max vs nonshared's max | tokens computed (median) | gates |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for arm, s in res["summary"].items():
        gates = ", ".join(f"{g} {s['gates'].count(g)}" for g in sorted(set(s["gates"]))) or "-"
        lines.append(
            f"| {arm} | {s['ttft_median_s']:.2f} | {s['vs_nonshared']:.2f} | {s['ttft_max_s']:.2f} | "
            f"{s['max_vs_nonshared_max']:.2f} | {s['computed_tokens']:.0f} | {gates} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=4096, help="shared context tokens")
    ap.add_argument("--contexts", type=int, default=3, help="workflows per arm, each on a context of its own")
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--out", type=Path, default=Path("results/fallback_cost_4k.json"))
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    from sglang_kvshare.assets import ensure_default_model

    tok = AutoTokenizer.from_pretrained(ensure_default_model())
    t0 = time.time()
    turns: dict = {arm: [] for arm in ARMS}
    with tempfile.TemporaryDirectory() as logs, tqdm(total=len(ARMS) * args.contexts) as bar:
        bar.set_description("starting the server")
        server = Server(["-m", "sglang_kvshare.launch_server"], Path(logs) / "server.log", timeout=900)
        try:
            with requests.Session() as session:
                for k in range(args.contexts):
                    for arm in list(ARMS) if k % 2 == 0 else list(ARMS)[::-1]:
                        bar.set_description(f"context {k + 1}/{args.contexts}: {arm}")
                        settle(server)
                        wf = f"cost-{k}-{arm}"
                        turns[arm].append(
                            later_turn(server, session, make_context(tok, args.context, wf), wf, arm, args.output_len)
                        )
                        bar.update()
        finally:
            server.stop()
    res = {
        "config": {**vars(args), "out": str(args.out), "minutes": round((time.time() - t0) / 60, 1)},
        "summary": summarise(turns),
        "turns": turns,
    }
    save(args.out, res, markdown(res))


if __name__ == "__main__":
    main()
