"""Does a dense fallback's anchor factorisation stall other requests? Scheduler steps, measured
from a client: one plain request decodes a long answer (streamed; each chunk is one scheduler
step) while kvcmas workflows with long shared contexts run beside it at ``tau`` 0, so every later
agent falls back densely and its observation is factorised. The same on two servers,
``--kvshare-observe inline`` (factorised inside the scheduler step that releases the request)
and ``background`` (the default: a child process beside the scheduler), one after the other.

The decoding request's gaps between chunks fall in two kinds. A gap that overlaps a workflow
turn's prefill (from its POST to its first token) contains that prefill step; these are the same
in both modes and long at 2K tokens. Every other gap is a decode step, and an observation
factorised inline lands in one of them: the turn is released after its last token, and the
driver then pauses ``--pause`` s before the next turn so that only decoding runs meanwhile.
Reported per mode: the decode gaps (p50, p99, max, how many exceed ``--stall-factor`` x the
p50), the prefill gaps, the factorisations done, and the background / inline ratios.

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
from typing import Any, Dict, List, Sequence, Tuple

import requests

from benchmarks.client import stream_generate
from benchmarks.serving.workload import make_context
from sglang_kvshare.routing import routing_headers
from sglang_kvshare.testing.workflows import make_roles
from sglang_kvshare.workflows import build_payload, build_segments

Interval = Tuple[float, float]


def decode_gaps(url: str, stop: threading.Event, out: List[Interval]) -> None:
    """Stream plain long answers until ``stop``; append each gap between chunks as (start, end)."""
    body = {
        "text": "Write a long story about a lighthouse keeper.",
        "stream": True,
        "sampling_params": {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True},
    }
    while not stop.is_set():
        with requests.post(url + "/generate", json=body, stream=True, timeout=900) as r:
            last = None
            for line in r.iter_lines():
                if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                    continue
                now = time.perf_counter()
                if last is not None and not stop.is_set():
                    out.append((last, now))
                last = now
                if stop.is_set():
                    break


def split_gaps(gaps: Sequence[Interval], prefills: Sequence[Interval]) -> Tuple[List[float], List[float]]:
    """(decode gap lengths, prefill gap lengths): a gap is a prefill gap when it overlaps one of
    ``prefills`` (a turn's POST to its first token), else a decode gap."""
    decode, prefill = [], []
    for a, b in gaps:
        (prefill if any(a < pe and b > ps for ps, pe in prefills) else decode).append(b - a)
    return decode, prefill


def summary(values: Sequence[float], stall_factor: float) -> Dict[str, Any]:
    s = sorted(values)
    if not s:
        return {"n": 0}
    p50 = statistics.median(s)
    return {
        "n": len(s),
        "p50_s": p50,
        "p99_s": s[int(0.99 * (len(s) - 1))],
        "max_s": s[-1],
        "stalls": sum(1 for v in s if v > stall_factor * p50),
    }


def workflows(url: str, tok, n: int, context: int, tag: str, pause: float) -> List[Interval]:
    """Run the kvcmas workflows (every gate rejects); returns each turn's (POST, first token)."""
    task, final = make_roles(3)
    roles = task + [final]
    prefills: List[Interval] = []
    with requests.Session() as session:
        for w in range(n):
            ctx, outs = make_context(tok, context, f"{tag}-{w}"), []
            for i, role in enumerate(roles):
                reads = [(roles[j].name, roles[j].title, outs[j]) for j in range(i)]
                p = build_payload(role, build_segments(role, ctx, reads), f"{tag}-{w}", "kvcmas", 8)
                p["kvshare"]["tau"] = 0.0  # every gate rejects: every later agent is an observation
                t0 = time.perf_counter()
                r = stream_generate(session, url, p, 900, headers=routing_headers(p))
                prefills.append((t0, t0 + r.ttft_s))
                outs.append(r.text)
                time.sleep(pause)  # released: an inline factorisation runs now, beside decoding only
    return prefills


def one_mode(mode: str, args, tok) -> Dict[str, Any]:
    from sglang_kvshare.testing.server import Server

    log = Path(tempfile.mkdtemp(prefix=f"stall-{mode}-")) / "server.log"
    server = Server(["-m", "sglang_kvshare.launch_server", "--kvshare-observe", mode], log, timeout=900)
    try:
        gaps: List[Interval] = []
        stop = threading.Event()
        t = threading.Thread(target=decode_gaps, args=(server.url, stop, gaps), daemon=True)
        t.start()
        time.sleep(3)
        t0 = time.perf_counter()
        prefills = workflows(server.url, tok, args.workflows, args.context, mode, args.pause)
        wall = time.perf_counter() - t0
        stop.set()
        t.join(timeout=120)
        state = requests.get(server.url + "/server_info", timeout=30).json()["internal_states"][0]["kvshare"]
    finally:
        server.stop()
    decode, prefill = split_gaps([g for g in gaps if g[0] >= t0 - 1.0], prefills)
    return {
        "mode": mode,
        "workflows_s": wall,
        "decode_gaps": summary(decode, args.stall_factor),
        "prefill_gaps": summary(prefill, args.stall_factor),
        "observations": state["observations_done"],
        "anchors": state["correctors"]["kvcmas"]["num_anchors"],
    }


def main(argv=None) -> Dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--workflows", type=int, default=3)
    ap.add_argument("--pause", type=float, default=2.0, help="seconds between a turn's end and the next turn")
    ap.add_argument("--stall-factor", type=float, default=3.0, help="a decode gap above this x its p50 is a stall")
    ap.add_argument("--out", type=Path, default=Path("results/observe_stall.json"))
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    from sglang_kvshare.assets import ensure_default_model

    tok = AutoTokenizer.from_pretrained(ensure_default_model())
    rows = [one_mode(m, args, tok) for m in ("inline", "background")]
    ratio = {f"decode_{k}": rows[1]["decode_gaps"][k] / rows[0]["decode_gaps"][k] for k in ("p50_s", "p99_s", "max_s")}
    ratio["workflows_s"] = rows[1]["workflows_s"] / rows[0]["workflows_s"]
    res = {
        "benchmark": "observe_stall",
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "modes": rows,
        "ratio_background_over_inline": ratio,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2) + "\n")
    print(
        f"| observe | decode gaps | p50 s | p99 s | max s | > {args.stall_factor:g}x p50 | prefill gaps | "
        "prefill max s | factorisations | workflows s |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    for r in rows:
        d, p = r["decode_gaps"], r["prefill_gaps"]
        print(
            f"| {r['mode']} | {d['n']} | {d['p50_s']:.3f} | {d['p99_s']:.3f} | {d['max_s']:.3f} | {d['stalls']} | "
            f"{p['n']} | {p.get('max_s', 0):.2f} | {r['observations']} | {r['workflows_s']:.1f} |"
        )
    return res


if __name__ == "__main__":
    main()
