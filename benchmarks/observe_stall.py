"""Does a dense fallback's anchor factorisation stall other requests? Scheduler steps, measured
from a client: one plain request decodes a long answer (streamed; each chunk is one scheduler
step) while kvcmas workflows with long shared contexts and cold anchor pools run beside it, so
every later agent falls back densely and its observation is factorised. The same on two
servers, ``--kvshare-observe inline`` (inside the scheduler step) and ``background`` (the
default: a child process beside the scheduler), one after the other.

Reported per mode: the decoding request's gaps between chunks (p50, p99, max) during the
workflows, the number of factorisations done, and the gaps' ratio background / inline.

    python -m benchmarks.observe_stall [--context 2048] [--workflows 3] [--out results/observe_stall.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Dict, List

import requests

from benchmarks.serving import make_context, make_roles
from sglang_kvshare.workflows import build_payload, build_segments


def decode_gaps(url: str, stop: threading.Event, out: List[float]) -> None:
    """Stream plain long answers until ``stop``; append the gaps between chunks (s)."""
    body = {"text": "Write a long story about a lighthouse keeper.", "stream": True,
            "sampling_params": {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}}
    while not stop.is_set():
        with requests.post(url + "/generate", json=body, stream=True, timeout=900) as r:
            last = None
            for line in r.iter_lines():
                if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                    continue
                now = time.perf_counter()
                if last is not None and not stop.is_set():
                    out.append(now - last)
                last = now
                if stop.is_set():
                    break


def workflows(url: str, tok, n: int, context: int, tag: str) -> None:
    task, final = make_roles(3)
    roles = task + [final]
    for w in range(n):
        ctx, outs = make_context(tok, context, f"{tag}-{w}"), []
        for i, role in enumerate(roles):
            reads = [(roles[j].name, roles[j].title, outs[j]) for j in range(i)]
            p = build_payload(role, build_segments(role, ctx, reads), f"{tag}-{w}", "kvcmas", 8)
            p["kvshare"]["tau"] = 0.0  # every gate rejects: every later agent is an observation
            r = requests.post(url + "/generate", json=p, timeout=900)
            r.raise_for_status()
            outs.append(r.json()["text"])


def one_mode(mode: str, args, tok) -> Dict[str, Any]:
    from tests.integration.server import Server

    log = Path(tempfile.mkdtemp(prefix=f"stall-{mode}-")) / "server.log"
    server = Server(["-m", "sglang_kvshare.launch_server", "--kvshare-observe", mode], log, timeout=900)
    try:
        gaps: List[float] = []
        stop = threading.Event()
        t = threading.Thread(target=decode_gaps, args=(server.url, stop, gaps), daemon=True)
        t.start()
        time.sleep(3)
        t0 = time.perf_counter()
        workflows(server.url, tok, args.workflows, args.context, mode)
        wall = time.perf_counter() - t0
        time.sleep(2)
        stop.set()
        t.join(timeout=120)
        state = requests.get(server.url + "/server_info", timeout=30).json()["internal_states"][0]["kvshare"]
    finally:
        server.stop()
    s = sorted(gaps)
    return {"mode": mode, "workflows_s": wall, "gaps": len(s), "gap_p50_s": statistics.median(s),
            "gap_p99_s": s[int(0.99 * (len(s) - 1))], "gap_max_s": s[-1],
            "observations": state["observations_done"], "anchors": state["correctors"]["kvcmas"]["num_anchors"]}


def main(argv=None) -> Dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--workflows", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("results/observe_stall.json"))
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    from sglang_kvshare.assets import ensure_default_model

    tok = AutoTokenizer.from_pretrained(ensure_default_model())
    rows = [one_mode(m, args, tok) for m in ("inline", "background")]
    res = {"benchmark": "observe_stall", "config": {"context": args.context, "workflows": args.workflows},
           "modes": rows,
           "ratio_background_over_inline": {k: rows[1][k] / rows[0][k] for k in ("gap_p99_s", "gap_max_s", "workflows_s")}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2) + "\n")
    print("| observe | decode gap p50 s | p99 | max | factorisations | workflows s |\n|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['mode']} | {r['gap_p50_s']:.3f} | {r['gap_p99_s']:.3f} | {r['gap_max_s']:.3f} | "
              f"{r['observations']} | {r['workflows_s']:.1f} |")
    return res


if __name__ == "__main__":
    main()
