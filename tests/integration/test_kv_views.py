"""KV views (one copy of a shared context) in the real engine: later fullshared agents read the
source's KV slots in place (the tiny server's default) and generate exactly what copy mode
(``--no-kvshare-kv-views``) generates, while the tree holds each shared segment once."""

from __future__ import annotations

import concurrent.futures as cf
import time

import pytest
import requests

from sglang_kvshare.integration.cache.views import MIN_VIEW_TOKENS
from sglang_kvshare.testing.server import kvshare_server
from sglang_kvshare.testing.workflows import flush_cache, payload, scrape_metrics, segments, settle

AGENTS = ("solver", "critic", "final")


def _module_server(tmp_path_factory, tiny_model, name: str, *flags: str):
    """A tiny-model server with ``flags`` for one module's fixture (``yield from``)."""
    server = kvshare_server(tiny_model, tmp_path_factory.mktemp(name) / "server.log", *flags)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def copy_server(tmp_path_factory, tiny_model):
    yield from _module_server(tmp_path_factory, tiny_model, "tiny-copy", "--no-kvshare-kv-views")


def _workflow(server, wf: str, max_new_tokens: int = 16) -> list[dict]:
    """The sequential 3-agent fullshared workflow, greedy, with each output token's logprob."""
    outputs: dict[str, str] = {}
    results = []
    for agent in AGENTS:
        body = payload(wf, agent, "fullshared", segments(agent, outputs), max_new_tokens)
        body["return_logprob"] = True
        r = server.generate(body)
        assert r.status_code == 200, r.text
        results.append(r.json())
        outputs[agent] = r.json()["text"]
    return results


def test_views_generate_as_copy_mode_and_hold_one_copy(tiny_server, copy_server):
    runs, grown = {}, {}
    for name, server in (("views", tiny_server), ("copy", copy_server)):
        flush_cache(server)
        before = settle(server)["tree_tokens"]
        runs[name] = _workflow(server, f"views-vs-copy-{name}")
        grown[name] = settle(server)["tree_tokens"] - before
    viewed = 0
    for v, c in zip(runs["views"], runs["copy"]):
        mv, mc = v["meta_info"]["kvshare"], c["meta_info"]["kvshare"]
        assert mv["injected_tokens"] == mc["injected_tokens"]
        # spans of MIN_VIEW_TOKENS or more are read in place (the question), shorter ones copied
        long_spans = sum(n for seg in mv["segments"] if (n := seg.get("injected_tokens", 0)) >= MIN_VIEW_TOKENS)
        assert mv["view_tokens"] == long_spans and mc["view_tokens"] == 0
        viewed += mv["view_tokens"]
        assert v["output_ids"] == c["output_ids"]
        lv = [t[0] for t in v["meta_info"]["output_token_logprobs"]]
        lc = [t[0] for t in c["meta_info"]["output_token_logprobs"]]
        assert lv == pytest.approx(lc, abs=1e-4)
    assert viewed > 500  # the question, twice
    # the views' slots are the sources': the tree holds them once
    assert grown["views"] == grown["copy"] - viewed
    assert grown["views"] <= 0.5 * grown["copy"]


def _gauge(server, name: str) -> float | None:
    values = [v for (n, _), v in scrape_metrics(server).items() if n == name]
    return values[0] if values else None


def test_tree_and_view_tokens_are_gauges(tiny_server):
    """``kvshare_view_tokens`` counts a live reader's view while it decodes (SGLang publishes
    its gauges every 40 decode steps); once idle, ``kvshare_tree_tokens`` is ``/server_info``'s."""
    flush_cache(tiny_server)
    first = tiny_server.generate(payload("views-gauges", "solver", "fullshared", segments("solver", {}), 4))
    assert first.status_code == 200
    body = payload("views-gauges", "critic", "fullshared", segments("critic", {}), 240)
    body["sampling_params"]["ignore_eos"] = True
    with cf.ThreadPoolExecutor(1) as pool:
        reader = pool.submit(tiny_server.generate, body)
        seen = set()
        while not reader.done():
            seen.add(_gauge(tiny_server, "kvshare_view_tokens"))
    r = reader.result()
    assert r.status_code == 200, r.text
    viewed = r.json()["meta_info"]["kvshare"]["view_tokens"]
    assert viewed > 100 and viewed in seen, (viewed, seen)
    tree_tokens = settle(tiny_server)["tree_tokens"]
    deadline = time.time() + 60  # an idle scheduler republishes once its running count went stale
    while (_gauge(tiny_server, "kvshare_tree_tokens"), _gauge(tiny_server, "kvshare_view_tokens")) != (
        tree_tokens,
        0,
    ) and time.time() < deadline:
        time.sleep(0.5)
    assert _gauge(tiny_server, "kvshare_tree_tokens") == tree_tokens > viewed
    assert _gauge(tiny_server, "kvshare_view_tokens") == 0


def _facts(seed: int, n: int) -> str:
    return (
        "Question: "
        + " ".join(f"Fact {i}: box {i} holds {(seed * 31 + i * 7) % 90} red apples." for i in range(n))
        + " Sum?"
    )


@pytest.fixture(scope="module")
def full_leaf_server(tmp_path_factory, tiny_model):  # rank 32: the tiny model's K/V width
    yield from _module_server(tmp_path_factory, tiny_model, "tiny-leaf32", "--kvshare-leaf-rank", "32")


def _kvcmas(server, wf: str, question: str, slot: str, **extra) -> list[dict]:
    """The 3-agent kvcmas chain over ``question`` (gate open), greedy, with logprobs."""
    outputs, results = {}, []
    for agent in AGENTS:
        body = payload(wf, agent, "kvcmas", segments(agent, outputs, question=question, slot=slot), 8, tau=1.0, **extra)
        body["return_logprob"] = True
        r = server.generate(body)
        assert r.status_code == 200, r.text
        results.append(r.json())
        outputs[agent] = r.json()["text"]
    settle(server)
    return results


def _segment(result: dict) -> dict:
    """The question's segment record of a workflow turn (segment 0 is the system prompt)."""
    return result["meta_info"]["kvshare"]["segments"][1]


def _read(segment: dict) -> int:
    """Tokens of a corrected segment read in the source's slots: all but its head rows."""
    return segment["tokens"] - segment.get("recomputed_head", 0)


def _leaf_and_copy(server, slot: str):
    """Anchors from two short questions (dense fallbacks), then one long question with KV
    leaves (asked for: ``leaves: true``) and in copy mode: (leaf results, copy results, tree
    growth of each)."""
    for seed in (1, 2):
        _kvcmas(server, f"{slot}-warm-{seed}", _facts(seed, 5), slot)
    question, grown, runs = _facts(9, 24), {}, {}
    for mode, extra in (("leaf", {"leaves": True}), ("copy", {"kv_views": False})):
        before = settle(server)["tree_tokens"]
        runs[mode] = _kvcmas(server, f"{slot}-{mode}", question, slot, **extra)
        grown[mode] = settle(server)["tree_tokens"] - before
    return runs["leaf"], runs["copy"], grown


def test_full_rank_leaves_generate_as_copy_mode(full_leaf_server):
    """An accepted correction kept as view + leaf at full rank (the tiny model's 32 K/V columns)
    is what a corrected copy holds, along the chain (each later agent corrected from the one
    before, whose leaf it inherits): the same greedy tokens and logprobs as copy mode, while the
    tree holds the question once. A flush drops every leaf."""
    leaf, copy, grown = _leaf_and_copy(full_leaf_server, "q-leaf-full")
    for lr, cr in zip(leaf[1:], copy[1:]):
        ml, mc = lr["meta_info"]["kvshare"], cr["meta_info"]["kvshare"]
        q, qc = ml["segments"][1], mc["segments"][1]
        assert q["mode"] == qc["mode"] == "corrected" and q["leaf_rank"] == 32, q
        assert q["corrected_rows"] == qc["corrected_rows"] > 0 and "leaf_rank" not in qc
        assert q.get("recomputed_head", 0) == qc.get("recomputed_head", 0)  # computed by the chunk before
        assert ml["view_tokens"] >= _read(q) and mc["view_tokens"] == 0
        assert lr["output_ids"] == cr["output_ids"]
        ll = [t[0] for t in lr["meta_info"]["output_token_logprobs"]]
        lc = [t[0] for t in cr["meta_info"]["output_token_logprobs"]]
        assert ll == pytest.approx(lc, abs=1e-3)
    assert grown["leaf"] <= grown["copy"] - sum(_read(_segment(r)) for r in leaf[1:])
    stats = settle(full_leaf_server)
    assert stats["leaves"] >= 2 and stats["leaf_bytes"] > 0
    flush_cache(full_leaf_server)
    stats = settle(full_leaf_server)
    assert stats["leaves"] == 0 and stats["leaf_bytes"] == 0 and stats["double_frees"] == 0


def test_leaves_are_rank_8_and_smaller_than_the_copy(tiny_server):
    """At the default rank an accepted correction kept as a leaf reads the source's slots and a
    rank-8 leaf (fewer bytes than the corrected rows' K/V) instead of a copy."""
    leaf, copy, grown = _leaf_and_copy(tiny_server, "q-leaf-8")
    q = _segment(leaf[1])
    assert q["mode"] == "corrected" and q["leaf_rank"] == 8, q
    assert leaf[1]["meta_info"]["kvshare"]["view_tokens"] >= _read(q)
    kv_bytes = leaf[1]["meta_info"]["kvshare"].get("kv_bytes_per_token")
    if kv_bytes:
        assert q["leaf_bytes"] < q["corrected_rows"] * kv_bytes
    assert grown["leaf"] < grown["copy"]


def test_concurrent_and_aborted_readers_free_every_slot_once(tiny_server):
    """Many readers of one source at once, some cut off by their client mid-generation: every
    shared slot is freed exactly once (SGLang's strict idle check would also stop the server)."""
    flush_cache(tiny_server)
    base = "views-churn"
    first = tiny_server.generate(payload(base, "solver", "fullshared", segments("solver", {}), 4))
    assert first.status_code == 200

    def read(i):
        body = payload(base, f"reader-{i}", "fullshared", segments("critic", {}), 24 if i % 3 else 400)
        try:
            r = tiny_server.generate(body, timeout=2 if i % 3 == 0 else 300)
            return r.json()["meta_info"]["kvshare"]["view_tokens"] if r.status_code == 200 else r.status_code
        except requests.exceptions.Timeout:
            return "client gone"

    with cf.ThreadPoolExecutor(6) as pool:
        results = list(pool.map(read, range(12)))
    viewed = [r for r in results if isinstance(r, int) and r > 100]
    assert len(viewed) >= 8, results
    flush_cache(tiny_server)  # waits for the readers whose clients left
    state = settle(tiny_server)
    assert state["double_frees"] == 0 and state["view_tokens"] == 0
    assert state["tree_tokens"] == 0 and state["shared_slot_refs"] == 0 and state["view_slots"] == 0
    again = tiny_server.generate(payload(base + "-2", "solver", "fullshared", segments("solver", {}), 4))
    assert again.status_code == 200


@pytest.fixture(scope="module")
def small_pool_server(tmp_path_factory, tiny_model):
    yield from _module_server(tmp_path_factory, tiny_model, "tiny-small-pool", "--max-total-tokens", "3000")


def _read_under_pressure(server, wf: str, question: str) -> dict:
    """A solver over ``question``, then a plain request that leaves about 150 free slots, then
    the critic's correction of the question (gate open): the critic's response."""
    first = server.generate(
        payload(wf, "solver", "kvcmas", segments("solver", {}, question=question, slot="q-policy"), 8, tau=1.0)
    )
    assert first.status_code == 200, first.text
    total = requests.get(server.url + "/server_info", timeout=30).json()["max_total_num_tokens"]
    filler = total - settle(server)["tree_tokens"] - 150
    plain = server.generate(
        {
            "input_ids": [1000 + i % 5000 for i in range(filler)],
            "sampling_params": {"max_new_tokens": 1, "temperature": 0},
        }
    )
    assert plain.status_code == 200, plain.text
    read = server.generate(
        payload(
            wf,
            "critic",
            "kvcmas",
            segments("critic", {"solver": first.json()["text"]}, question=question, slot="q-policy"),
            8,
            tau=1.0,
        )
    )
    assert read.status_code == 200, read.text
    q = _segment(read.json())
    assert q["corrected_rows"] > 150, q
    return read.json()


def test_leaf_policy_copies_with_room_and_leafs_when_a_copy_would_evict_reused_kv(small_pool_server):
    """``--kvshare-leaf-policy pressure`` (the default): an accepted correction is a corrected
    copy while the pool has free slots for it; once writing it would evict entries used more
    recently than sources are reused (the p90 time between a source's uses), it is a leaf,
    unless all it would evict is spent: sources that a later agent superseded."""
    server, pause = small_pool_server, 4.0
    flush_cache(server)
    for seed in (1, 2):  # anchors; every source is read ``pause`` s after its last use
        outputs = {}
        for agent in AGENTS:
            if outputs:
                time.sleep(pause)
            r = server.generate(
                payload(
                    f"policy-warm-{seed}",
                    agent,
                    "kvcmas",
                    segments(agent, outputs, question=_facts(seed, 24), slot="q-policy"),
                    8,
                    tau=1.0,
                )
            )
            assert r.status_code == 200, r.text
            outputs[agent] = r.json()["text"]
    assert settle(server)["reuse_horizon_s"] >= pause

    # pressure: the tree holds the source and fresh plain requests that leave fewer free slots
    # than the correction's rows; what eviction would take was used < ``pause`` s ago
    flush_cache(server)
    question = _facts(12, 24)
    read = _read_under_pressure(server, "policy-pressure", question)
    q = _segment(read)
    assert q["kept_as"] == "leaf" and q["leaf_rank"] == 8, q
    assert read["meta_info"]["kvshare"]["view_tokens"] >= q["tokens"]

    # room: after a flush the same chain writes corrected copies
    flush_cache(server)
    room = _kvcmas(server, "policy-room", question, "q-policy")
    for r in room[1:]:
        q = _segment(r)
        assert q["mode"] == "corrected" and q["kept_as"] == "copy" and "leaf_rank" not in q, q
    assert settle(server)["leaves"] == 0

    # spent: the same pressure, but the least recently used entries are a solver's whose
    # question and output the critic after it has recorded again; they were read seconds ago
    flush_cache(server)
    _kvcmas(server, "policy-spent-old", _facts(21, 24), "q-policy")
    q = _segment(_read_under_pressure(server, "policy-spent", question))
    assert q["kept_as"] == "copy", q


def test_soak_with_evictions_leaks_no_slot(small_pool_server):
    """The soak benchmark's short version: 100 requests, mixed methods, clients that leave, a
    pool small enough that sources are evicted under their readers."""
    from benchmarks.kv_views_soak import check, soak

    res = soak(small_pool_server, 100, seed=1)
    assert small_pool_server.proc.poll() is None, small_pool_server.log_tail()
    assert check(res) == [], res
    assert res["ok"] >= 70 and res["left"] >= 1, res
