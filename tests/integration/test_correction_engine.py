"""Correction methods inside the engine (tiny random-weight Llama): gate, fallback, chaining."""

from __future__ import annotations

import json
import random

import torch

from sglang_kvshare.testing.workflows import grew, payload, private_tokens, scrape_metrics, segments, settle


def _question(seed: int) -> str:
    rng = random.Random(seed)
    facts = " ".join(f"Fact {i}: box {i} holds {rng.randint(1, 90)} red apples." for i in range(20))
    return f"Question: {facts} How many red apples are in box {rng.randint(0, 19)}?"


def _workflow(server, wf, method, question, agents=("solver", "critic", "final"), slot="q", **extra):
    """Run the agents in order; the anchor pools are per slot, so each test names its own slot."""
    outputs, metas = {}, []
    for agent in agents:
        segs = segments(agent, outputs, question=question, slot=slot)
        r = server.generate(payload(wf, agent, method, segs, 6, **extra))
        assert r.status_code == 200, r.text
        out = r.json()
        metas.append(out["meta_info"]["kvshare"])
        if out["text"]:
            outputs[agent] = out["text"]
    settle(server)  # the fallbacks' anchors exist before the next workflow
    return metas


def _err(server, wf_a, wf_b, agent, slot):
    from sglang_kvshare.integration.cache.radix import _safe

    def load(wf):
        return torch.load(server.dump_dir / _safe(wf) / _safe(agent) / f"{_safe(slot)}.pt")

    a, b = load(wf_a), load(wf_b)
    num = ((a["k"] - b["k"]).square().sum() + (a["v"] - b["v"]).square().sum()).sqrt()
    return float(num / (b["k"].square().sum() + b["v"].square().sum()).sqrt())


def test_kvcmas_falls_back_then_corrects_and_chains(tiny_server):
    # two workflows with different questions: every edge is a dense fallback and adds an anchor
    for seed in (1, 2):
        metas = _workflow(tiny_server, f"kvcmas-warm-{seed}", "kvcmas", _question(seed), slot="q-chain", tau=1.0)
        assert metas[0]["computed_tokens"] == metas[0]["prompt_tokens"]  # first agent: dense
        q = metas[1]["segments"][1]
        assert q["mode"] == "dense_fallback" and q["gate"] == "few_anchors"
    assert metas[-1]["anchor_bytes"] > 0
    # a third question: two compatible anchors now, tau = 1 accepts
    metas = _workflow(tiny_server, "kvcmas-run", "kvcmas", _question(3), slot="q-chain", tau=1.0)
    critic, final = metas[1], metas[2]
    q = critic["segments"][1]
    assert q["mode"] == "corrected" and q["gate"] == "accepted" and q["anchors"] == 2
    assert 0.0 <= q["entropy"] <= 1.0
    assert q["source_agent"] == "solver"
    # chained: the final agent's question cache comes from the critic's corrected cache
    assert final["segments"][1]["mode"] == "corrected"
    assert final["segments"][1]["source_agent"] == "critic"
    for meta in (critic, final):
        missing = sum(s["tokens"] - s.get("injected_tokens", 0) for s in meta["segments"] if s["mode"] == "corrected")
        fallback = sum(s["tokens"] for s in meta["segments"] if s["mode"] == "dense_fallback")
        # a segment within the head rows (the solver's short answer) is computed
        within = sum(s["tokens"] for s in meta["segments"] if s["shared"] and s["mode"] == "computed")
        assert all(
            s["recomputed_head"] == s["tokens"] for s in meta["segments"] if s["shared"] and s["mode"] == "computed"
        )
        assert meta["computed_tokens"] == private_tokens(meta) + missing + fallback + within, meta["segments"]


def test_a_strict_gate_rejects_and_computes_densely(tiny_server):
    for seed in (11, 12):
        _workflow(
            tiny_server,
            f"strict-warm-{seed}",
            "kvcmas",
            _question(seed),
            ("solver", "critic"),
            slot="q-strict",
            tau=0.0,
        )
    metas = _workflow(
        tiny_server, "strict-run", "kvcmas", _question(13), ("solver", "critic"), slot="q-strict", tau=0.0
    )
    q = metas[1]["segments"][1]
    assert q["mode"] == "dense_fallback" and q["gate"] in ("entropy", "few_anchors")
    assert metas[1]["computed_tokens"] == metas[1]["prompt_tokens"]


def test_kvcmas_corrects_better_than_fullshared_with_a_near_anchor(tiny_server):
    # anchors from questions 21 and 22; then question 21 again: the matching anchor's delta is
    # the true one, so the corrected cache must be closer to dense than the uncorrected source
    for seed in (21, 22):
        _workflow(tiny_server, f"near-warm-{seed}", "kvcmas", _question(seed), ("solver", "critic"), "q-near", tau=1.0)
    # the corrected cache as a copy: the tiny random model's deltas are not low-rank, so a
    # rank-8 KV leaf (the default) keeps only part of the correction (full-rank leaves equal the
    # copy: test_kv_views.py)
    for wf, method in (("near-kvcmas", "kvcmas"), ("near-full", "fullshared"), ("near-dense", "nonshared")):
        _workflow(tiny_server, wf, method, _question(21), ("solver", "critic"), "q-near", tau=1.0, kv_views=False)
    err_kvcmas = _err(tiny_server, "near-kvcmas", "near-dense", "critic", "q-near")
    err_full = _err(tiny_server, "near-full", "near-dense", "critic", "q-near")
    assert err_full > 1e-3
    assert err_kvcmas < 0.5 * err_full


def test_kvcomm_prefills_references_and_corrects_the_first_agent(tiny_server):
    first = _workflow(tiny_server, "kvcomm-0", "kvcomm", _question(31), ("solver",), "q-kvcomm", tau=1.0)[0]
    assert first["reference_tokens"] > 0
    assert first["computed_tokens"] == first["prompt_tokens"] + first["reference_tokens"]
    for seed in (32, 33):
        _workflow(tiny_server, f"kvcomm-{seed}", "kvcomm", _question(seed), ("solver",), "q-kvcomm", tau=1.0)
    meta = _workflow(tiny_server, "kvcomm-run", "kvcomm", _question(34), ("solver",), "q-kvcomm", tau=1.0)[0]
    q = meta["segments"][1]
    assert q["mode"] == "corrected" and q["source_agent"] == "__reference__"  # non-chained
    assert meta["computed_tokens"] == private_tokens(meta) + meta["reference_tokens"]


def test_graphflow_applies_a_recorded_relation_without_matching(tiny_server):
    _workflow(tiny_server, "gf-0", "graphflow", _question(41), ("solver", "critic"), "q-gf")
    metas = _workflow(tiny_server, "gf-1", "graphflow", _question(42), ("solver", "critic"), "q-gf")
    q = metas[1]["segments"][1]
    assert q["mode"] == "corrected" and q["anchors"] == 0 and q["entropy"] is None


def _rows_error(server, wf, agent, slot, dense_wf):
    """Per row of a dumped segment: squared K/V distance to the dense workflow's cache."""
    from sglang_kvshare.integration.cache.radix import _safe

    def load(w):
        return torch.load(server.dump_dir / _safe(w) / _safe(agent) / f"{_safe(slot)}.pt")

    a, b = load(wf), load(dense_wf)
    return ((a["k"] - b["k"]).square().sum((0, 2, 3)) + (a["v"] - b["v"]).square().sum((0, 2, 3))), a


def test_partial_fallback_recomputes_only_the_rejected_blocks(tiny_server):
    """``fallback: rows``: a segment the gate rejects is gated again per block; the rejected
    blocks are recomputed in the forward (closer to the dense cache than the correction was),
    the accepted rows keep the correction, and the request is charged exactly the recomputed rows."""
    slot, agents, block = "q-rows", ("solver", "critic"), 16
    for seed in (51, 52):
        _workflow(tiny_server, f"rows-warm-{seed}", "kvcmas", _question(seed), agents, slot, tau=1.0)
    rows = dict(fallback="rows", fallback_block=block, recompute_head=0)  # the rejected blocks alone
    # the probe's accepted correction as a copy (a KV leaf is low-rank), as the partial fallback keeps it
    probe = _workflow(
        tiny_server, "rows-probe", "kvcmas", _question(53), agents, slot, tau=1.0, kv_views=False, **rows
    )[1]
    q = probe["segments"][1]
    assert q["mode"] == "corrected" and q["rejected_blocks"] == 0 and q["block_size"] == block
    entropies, segment = q["block_entropies"], q["entropy"]
    assert len(entropies) == -(-q["corrected_rows"] // block)
    # a tau that rejects the segment and keeps its clearer blocks
    low, high = [h for h in entropies if h < segment], [h for h in entropies if h > segment]
    assert low and high, (segment, entropies)
    tau = (max(low) + min(high + [segment])) / 2
    rejected = [i for i, h in enumerate(entropies) if h > tau]

    before = scrape_metrics(tiny_server)
    meta = _workflow(tiny_server, "rows-run", "kvcmas", _question(53), agents, slot, tau=tau, **rows)[1]
    q = meta["segments"][1]
    assert q["mode"] == "corrected" and q["gate"] == "partial", json.dumps(q)
    assert q["block_entropies"] == entropies and q["entropy"] > tau
    rows_of = [r for i in rejected for r in range(i * block, min((i + 1) * block, q["corrected_rows"]))]
    assert q["rejected_blocks"] == len(rejected) and q["recomputed_rows"] == len(rows_of)
    assert q["injected_tokens"] == q["tokens"] - len(rows_of)
    missing = sum(s["tokens"] - s.get("injected_tokens", 0) for s in meta["segments"] if s["mode"] == "corrected")
    fallback = sum(s["tokens"] for s in meta["segments"] if s["mode"] == "dense_fallback")
    assert meta["computed_tokens"] == private_tokens(meta) + missing + fallback
    assert meta["recomputed_rows"] >= len(rows_of)
    after = scrape_metrics(tiny_server)
    assert grew(before, after, "kvshare_recomputed_rows_total", method="kvcmas") == meta["recomputed_rows"]
    assert grew(before, after, "kvshare_corrections_total", method="kvcmas", outcome="rejected", reason="partial") >= 1

    _workflow(tiny_server, "rows-dense", "nonshared", _question(53), agents, slot)
    err_probe, probe_kv = _rows_error(tiny_server, "rows-probe", "critic", slot, "rows-dense")
    err_run, run_kv = _rows_error(tiny_server, "rows-run", "critic", slot, "rows-dense")
    kept = torch.ones(len(err_run), dtype=torch.bool)
    kept[rows_of] = False
    # accepted rows: the correction itself, written unchanged; rejected rows: recomputed
    assert torch.equal(run_kv["v"][:, kept], probe_kv["v"][:, kept])
    assert float(err_run[rows_of].sum()) < 0.5 * float(err_probe[rows_of].sum())

    # the same gate with the papers' fallback prefills the whole segment densely
    dense = _workflow(
        tiny_server, "rows-dense-fallback", "kvcmas", _question(54), agents, slot, tau=0.0, fallback="dense"
    )[1]
    assert dense["segments"][1]["mode"] == "dense_fallback" and "block_entropies" not in dense["segments"][1]


def test_recomputed_head_rows_are_the_dense_rows(tiny_server):
    """``recompute_head``: an accepted correction's first rows (those near where the contexts
    diverge) are computed by the chunk before it, attending the agent's own prefix, so their K/V
    are a dense prefill's (the correction's are not); the other rows keep the correction; the
    request is charged the recomputed rows."""
    slot, agents, head = "q-head", ("solver", "critic"), 8
    for seed in (61, 62):
        _workflow(tiny_server, f"head-warm-{seed}", "kvcmas", _question(seed), agents, slot, tau=1.0)
    probe = _workflow(
        tiny_server, "head-probe", "kvcmas", _question(63), agents, slot, tau=1.0, kv_views=False, recompute_head=0
    )[1]
    q = probe["segments"][1]
    assert q["mode"] == "corrected" and "recomputed_head" not in q and "recomputed_rows" not in q
    meta = _workflow(
        tiny_server, "head-run", "kvcmas", _question(63), agents, slot, tau=1.0, kv_views=False, recompute_head=head
    )[1]
    q = meta["segments"][1]
    # the rows within ``head`` tokens of where the critic's prompt diverges from the solver's
    # (SourceRecord.head_rows): the agents' prompts end alike before the question
    assert q["mode"] == "corrected" and 0 < q["recomputed_head"] < head, json.dumps(q)
    assert q["recomputed_rows"] == q["recomputed_head"]
    assert "observed" not in q  # computed by the chunk before the segment, not a recompute job
    head = q["recomputed_head"]
    assert q["injected_tokens"] == q["tokens"] - head
    _workflow(tiny_server, "head-dense", "nonshared", _question(63), agents, slot)
    err_probe, probe_kv = _rows_error(tiny_server, "head-probe", "critic", slot, "head-dense")
    err_run, run_kv = _rows_error(tiny_server, "head-run", "critic", slot, "head-dense")
    assert float(err_probe[:head].sum()) > 0
    assert float(err_run[:head].sum()) < 0.01 * float(err_probe[:head].sum()), (err_run[:head], err_probe[:head])
    assert torch.equal(run_kv["v"][:, head:], probe_kv["v"][:, head:])


def test_bad_fallback_values_get_a_clear_error(tiny_server):
    for extra, named in (
        ({"fallback": "partial"}, "kvshare.fallback"),
        ({"fallback_block": 0}, "kvshare.fallback_block"),
        ({"fallback_block": 1.5}, "kvshare.fallback_block"),
        ({"recompute_head": -2}, "kvshare.recompute_head"),
    ):
        r = tiny_server.generate(payload("rows-bad", "solver", "kvcmas", segments("solver", {}), 2, **extra))
        assert r.status_code == 400 and named in r.text, r.text
    assert tiny_server.generate(payload("rows-bad", "solver", "kvcmas", segments("solver", {}), 2)).status_code == 200
