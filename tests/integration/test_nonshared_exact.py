"""``nonshared`` is stock SGLang: on SmolLM2, 30 later-agent prompts of 300-2000 tokens (segments
from real notes, earlier agents' outputs as shared slots) give the same greedy tokens and the same
first-token distribution as stock SGLang 0.5.23 (``torch_native``) fed the same token ids.
``nonshared`` is the reference of every fidelity number, so it must not drift from stock."""

from __future__ import annotations

import math

import pytest

from sglang_kvshare.testing.server import kvshare_server, stock_server

pytestmark = pytest.mark.slow

LENGTHS = [300 + round(i * 1700 / 29) for i in range(30)]
TOP = 20


def _first_token_kl(ours: dict, stock: dict) -> float:
    """KL(stock || ours) over ours' top-``TOP`` first tokens (stock asked for exactly those ids)."""
    mine = {tid: lp for lp, tid, *_ in ours["meta_info"]["output_top_logprobs"][0]}
    theirs = {tid: lp for lp, tid, *_ in stock["meta_info"]["output_token_ids_logprobs"][0]}
    assert set(theirs) == set(mine)
    return sum(math.exp(theirs[t]) * (theirs[t] - mine[t]) for t in mine)


def test_nonshared_is_greedy_identical_to_stock_sglang(tmp_path, smollm2_path):
    from transformers import AutoTokenizer

    from benchmarks.serving.workload import make_context
    from sglang_kvshare.testing.workflows import make_roles
    from sglang_kvshare.workflows import build_payload, build_segments

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    task, final = make_roles(3)
    roles = task + [final]
    bodies = []
    for i, n in enumerate(LENGTHS):
        role = roles[1 + i % 2]  # a later agent: it reads the earlier agents' outputs
        reads = [(r.name, r.title, f"{r.title} thinks note {i % 7 + 1} is the hardest.") for r in roles[: 1 + i % 2]]
        body = build_payload(
            role, build_segments(role, make_context(tok, n, f"exact-{i}"), reads), f"exact-{i}", "nonshared", 8
        )
        body.update(return_logprob=True, top_logprobs_num=TOP, return_prompt_token_ids=True)
        body["sampling_params"]["ignore_eos"] = True
        bodies.append(body)

    ours, server = [], kvshare_server(smollm2_path, tmp_path / "ours.log")
    try:
        for body in bodies:
            r = server.generate(body, timeout=600)
            assert r.status_code == 200, r.text
            ours.append(r.json())
    finally:
        server.stop()
    stock, server = [], stock_server(smollm2_path, tmp_path / "stock.log")
    try:
        for out in ours:
            top_ids = [tid for _, tid, *_ in out["meta_info"]["output_top_logprobs"][0]]
            r = server.generate(
                {
                    "input_ids": out["prompt_token_ids"],
                    "return_logprob": True,
                    "token_ids_logprob": top_ids,
                    "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
                },
                timeout=600,
            )
            assert r.status_code == 200, r.text
            stock.append(r.json())
    finally:
        server.stop()
    for n, a, b in zip(LENGTHS, ours, stock):
        meta = a["meta_info"]["kvshare"]
        assert meta["computed_tokens"] == meta["prompt_tokens"] == b["meta_info"]["prompt_tokens"]
        assert n <= meta["prompt_tokens"] < n + 200, (n, meta["prompt_tokens"])
    kls = [_first_token_kl(a, b) for a, b in zip(ours, stock)]
    flips = [n for n, a, b in zip(LENGTHS, ours, stock) if a["output_ids"] != b["output_ids"]]
    assert not flips, f"greedy outputs differ from stock at prompt lengths {flips}; first-token KL {max(kls):.2e}"
    assert max(kls) <= 1e-6, kls
