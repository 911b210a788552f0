"""Soak of KV views: many annotated requests, mixed methods, clients that leave mid-generation,
evictions under a small KV pool; afterwards no slot may be leaked or freed twice.

Workflows of 3 agents (one shared question per workflow, earlier outputs shared) run 4 at a time;
each workflow draws its method (fullshared reads views; nonshared, kvcmas and cacheblend share the
same tree and pool), and every 7th request streams 64 tokens and its client hangs up after the first
chunk (so it leaves mid-generation however fast the server is). The server runs with views
on (the default) and a small ``--max-total-tokens``, so sources are evicted while readers hold
views. SGLang's strict idle check (available + evictable + protected == total) runs whenever the
server idles and stops it on a mismatch. At the end the tree is flushed and ``/server_info`` must
show no shared reference, no marked slot, no double free and an empty tree; the server's RSS is
sampled every ``--every`` requests (it should stay flat after the warm-up).

    python -m benchmarks.kv_views_soak                        # 1,000 requests, the default SmolLM2
    python -m benchmarks.kv_views_soak --requests 100 --max-total-tokens 3000
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import requests
from tqdm import tqdm

from benchmarks.serving.memory import find_server_pid, tree_rss_mb
from sglang_kvshare.testing.workflows import QUESTION, flush_cache, payload, segments, settle

METHODS = ("fullshared", "fullshared", "nonshared", "kvcmas", "cacheblend")
AGENTS = ("solver", "critic", "final")


def leave_mid_stream(url: str, body: dict):
    """Stream ``body`` (EOS ignored) and hang up after the first chunk: 'left', or the HTTP status."""
    body = {**body, "stream": True, "sampling_params": {**body["sampling_params"], "ignore_eos": True}}
    with requests.post(url + "/generate", json=body, stream=True, timeout=600) as r:
        if r.status_code != 200:
            return r.status_code
        next(r.iter_lines(), None)
    return "left"


def one_workflow(url: str, k: int, counter, rng: random.Random) -> list:
    """Agents in sequence; returns each request's outcome (HTTP status, or 'left')."""
    method = rng.choice(METHODS)
    question = f"Case {k}. " + QUESTION[: rng.randrange(200, len(QUESTION))]
    outputs, outcomes = {}, []
    for agent in AGENTS:
        i = next(counter)
        segs = segments(agent, outputs, question=question)
        if i % 7 == 0:
            outcomes.append(leave_mid_stream(url, payload(f"soak-{k}", agent, method, segs, 64)))
            continue
        body = payload(f"soak-{k}", agent, method, segs, rng.choice((4, 16, 64)))
        r = requests.post(url + "/generate", json=body, timeout=600)
        outcomes.append(r.status_code)
        if r.status_code == 200 and r.json()["text"]:
            outputs[agent] = r.json()["text"]
    return outcomes


def soak(
    server, n_requests: int, every: int = 100, concurrency: int = 4, seed: int = 0, pid: Optional[int] = None, bar=None
) -> dict:
    """Run about ``n_requests`` requests against ``server`` (a ``sglang_kvshare.testing.server.Server``);
    returns outcomes, RSS samples and the final ``kvshare`` state (after a flush)."""
    url = server.url
    counter = itertools.count()
    workflows = -(-n_requests // len(AGENTS))
    outcomes, rss = [], []
    with ThreadPoolExecutor(concurrency) as pool:
        futures = [
            pool.submit(one_workflow, url, k, counter, random.Random(seed * 100003 + k)) for k in range(workflows)
        ]
        for k, f in enumerate(futures):
            outcomes += f.result()
            if bar is not None:
                bar.update(len(AGENTS))
            if pid is not None and (k + 1) * len(AGENTS) % every < len(AGENTS):
                rss.append(tree_rss_mb(pid))
    flush_cache(server)
    state = settle(server)
    return {
        "requests": len(outcomes),
        "ok": outcomes.count(200),
        "left": outcomes.count("left"),
        "other": [o for o in outcomes if o not in (200, "left")],
        "rss_mb": rss,
        "state": state,
    }


def check(res: dict) -> list[str]:
    """What is wrong after a soak (empty: nothing)."""
    s = res["state"]
    problems = [
        f"{k} = {s.get(k)}"
        for k in ("double_frees", "shared_slot_refs", "view_slots", "tree_tokens", "view_tokens")
        if s.get(k) != 0
    ]
    if res["other"]:
        problems.append(f"unexpected responses: {res['other'][:5]}")
    return problems


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--max-total-tokens", type=int, default=4096)
    ap.add_argument("--every", type=int, default=100, help="RSS sample interval, requests")
    ap.add_argument("--out", type=Path, default=Path("results/kv_views_soak.json"))
    args = ap.parse_args(argv)
    from sglang_kvshare.testing.server import kvshare_server

    t0 = time.time()
    with tempfile.TemporaryDirectory() as logs:
        from sglang_kvshare.assets import ensure_default_model

        server = kvshare_server(
            ensure_default_model(),
            Path(logs) / "soak.log",
            "--max-total-tokens",
            str(args.max_total_tokens),
            timeout=900,
        )
        try:
            with tqdm(total=args.requests, desc="soak") as bar:
                res = soak(server, args.requests, args.every, pid=find_server_pid(server.url), bar=bar)
        finally:
            server.stop()
    res["minutes"] = round((time.time() - t0) / 60, 1)
    if len(res["rss_mb"]) >= 3:  # after the first sample (the warm-up): growth to the last one
        res["rss_growth_after_warmup_mb"] = round(res["rss_mb"][-1] - res["rss_mb"][1], 1)
    res["problems"] = check(res)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k != "state"}, indent=1))
    if res["problems"]:
        raise SystemExit("soak failed: " + "; ".join(res["problems"]))


if __name__ == "__main__":
    main()
