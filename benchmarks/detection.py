"""Automatic detection's cost next to a prefill: the time to find the repeated runs of a 2K/4K/8K-
token prompt in a scope that holds ``--earlier`` earlier requests, against the time stock SGLang
takes to prefill that prompt, on this CPU.

The scope is adversarial for the index: every earlier request is built from the same document's
chunks (another order and subset each, with its own filler between), so nearly every seed of the
new prompt has many candidates. Detection is what the server's HTTP process runs per request
(``integration/server/auto.py``): the search (``TokenIndex.find``), the prompt's character
offsets for its labels (the tokenizer's offset mapping), the labels and the indexing of the
prompt. Prefill is a fresh stock server's (``SGLANG_PLUGINS=none``, the tests' CPU flags) time
to answer the prompt's ``input_ids`` with one new token, median of ``--repeats``.

    python -m benchmarks.detection            # 2K, 4K, 8K tokens, 64 earlier requests
    python -m benchmarks.detection --quick    # 2K only, 8 earlier requests

Writes ``results/detection.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import requests
from tqdm import tqdm

from sglang_kvshare.assets import ensure_default_model
from sglang_kvshare.segments.labels import prompt_labels
from sglang_kvshare.segments.token_index import Entry, TokenIndex
from sglang_kvshare.testing.server import stock_server

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
from agent_contexts import report  # noqa: E402


def prompt_of(tok, chunks: list[str], rng: random.Random, tokens: int) -> list[int]:
    """About ``tokens`` token ids: chunks in a random order with a little filler before each."""
    parts, n = [], 0
    for chunk in rng.sample(chunks, len(chunks)):
        part = f"Note {rng.randint(0, 10**6)}: {chunk}\n\n"
        parts.append(part)
        n += len(tok.encode(part, add_special_tokens=False))
        if n >= tokens:
            break
    return tok.encode("".join(parts), add_special_tokens=False)[:tokens]


def detect_ms(tok, index: TokenIndex, ids: list[int], repeats: int) -> float:
    """Median time of the server's detection steps for one prompt (none of them indexed)."""
    text = tok.decode(ids)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        runs = index.find("scope", ids[:-1])
        offsets = tok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        labels = prompt_labels(len(ids), runs, "agent", [0] * len(offsets))
        entry = Entry("seq:new", "agent", "prompt", 0, ids, labels)
        times.append(1000 * (time.perf_counter() - t0))
    assert entry.ids and runs, "the prompt repeats the scope's chunks: runs must be found"
    return statistics.median(times)


def prefill_ms(url: str, ids: list[int], repeats: int) -> float:
    times = []
    for r in range(repeats + 1):
        t0 = time.perf_counter()
        out = requests.post(
            url + "/generate",
            timeout=600,
            json={"input_ids": [r] + ids[1:], "sampling_params": {"max_new_tokens": 1, "temperature": 0}},
        )
        out.raise_for_status()
        if r:  # the first one warms up
            times.append(1000 * (time.perf_counter() - t0))
    return statistics.median(times)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[2048, 4096, 8000])
    p.add_argument("--earlier", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=str(ROOT / "results" / "detection"))
    args = p.parse_args(argv)
    if args.quick:
        args.tokens, args.earlier = [2048], 8
    from transformers import AutoTokenizer

    model = ensure_default_model()
    tok = AutoTokenizer.from_pretrained(model)
    rng = random.Random(0)
    document, _ = report(0, 6000)
    lines = document.splitlines()
    chunks = ["\n".join(lines[i : i + 6]) for i in range(0, len(lines), 6)]
    rows = []
    with tempfile.TemporaryDirectory() as d:
        server = stock_server(model, Path(d) / "stock.log", timeout=900)
        try:
            for n in tqdm(args.tokens, desc="prompt sizes"):
                index = TokenIndex(64, 1 << 22, 1 << 24, 4)
                for k in range(args.earlier):
                    ids = prompt_of(tok, chunks, rng, n)
                    index.add(
                        "scope",
                        Entry(f"seq:{k}", f"agent{k % 4}", "prompt", 0, ids, [(0, len(ids), f"ctx:agent{k % 4}:1")]),
                    )
                ids = prompt_of(tok, chunks, rng, n)
                det, pre = detect_ms(tok, index, ids, args.repeats), prefill_ms(server.url, ids, args.repeats)
                rows.append(
                    {
                        "prompt_tokens": len(ids),
                        "earlier_requests": args.earlier,
                        "index_tokens": index.tokens,
                        "detect_ms": round(det, 2),
                        "prefill_ms": round(pre, 1),
                        "detect_vs_prefill": det / pre,
                    }
                )
        finally:
            server.stop()
    lines_md = [
        "| prompt tokens | earlier requests | index tokens | detection ms | stock prefill ms | detection / prefill |",
        "|---|---|---|---|---|---|",
    ]
    lines_md += [
        f"| {r['prompt_tokens']} | {r['earlier_requests']} | {r['index_tokens']} | {r['detect_ms']:.1f} | "
        f"{r['prefill_ms']:.0f} | {100 * r['detect_vs_prefill']:.2f} % |"
        for r in rows
    ]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"argv": vars(args), "rows": rows}, indent=1))
    out.with_suffix(".md").write_text("\n".join(lines_md) + "\n")
    print("\n".join(lines_md))


if __name__ == "__main__":
    main()
