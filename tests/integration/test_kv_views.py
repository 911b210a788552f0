"""KV views (one copy of a shared context) in the real engine: later fullshared agents read the
source's KV slots in place (the tiny server's default) and generate exactly what copy mode
(``--kvshare-kv-views off``) generates, while the tree holds each shared segment once."""

from __future__ import annotations

import concurrent.futures as cf
import time

import pytest
import requests

from sglang_kvshare.integration.cache.views import MIN_VIEW_TOKENS
from tests.integration.server import kvshare_server
from tests.integration.workflow_helpers import flush_cache, payload, scrape_metrics, segments, settle

AGENTS = ("solver", "critic", "final")


@pytest.fixture(scope="module")
def copy_server(tmp_path_factory, tiny_model):
    d = tmp_path_factory.mktemp("tiny-copy")
    server = kvshare_server(tiny_model, d / "server.log", "--kvshare-kv-views", "off")
    yield server
    server.stop()


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
            tree_tokens, 0) and time.time() < deadline:
        time.sleep(0.5)
    assert _gauge(tiny_server, "kvshare_tree_tokens") == tree_tokens > viewed
    assert _gauge(tiny_server, "kvshare_view_tokens") == 0


def _facts(seed: int, n: int) -> str:
    return "Question: " + " ".join(f"Fact {i}: box {i} holds {(seed * 31 + i * 7) % 90} red apples." for i in range(n)) + " Sum?"


def test_rows_a_correction_leaves_unchanged_are_read_in_place(tiny_server):
    """kvcmas corrects the rows its anchors cover (as long as the second-longest one); the rows
    after them are the source's, unchanged, and are read in place. Outputs equal copy mode's."""
    slot, agents = "q-views-rows", ("solver", "critic")

    def run(wf, question, **extra):
        outputs, metas = {}, []
        for agent in agents:
            body = payload(wf, agent, "kvcmas", segments(agent, outputs, question=question, slot=slot), 8, tau=1.0,
                           **extra)
            r = tiny_server.generate(body)
            assert r.status_code == 200, r.text
            metas.append(r.json())
            outputs[agent] = r.json()["text"]
        settle(tiny_server)
        return metas

    for seed in (1, 2):  # short questions: dense fallbacks, anchors of ~80 rows
        run(f"views-rows-warm-{seed}", _facts(seed, 5))
    long_question = _facts(9, 24)
    views = run("views-rows-on", long_question)[1]
    copy = run("views-rows-off", long_question, kv_views=False)[1]
    q = views["meta_info"]["kvshare"]["segments"][1]
    assert q["mode"] == "corrected" and q["corrected_rows"] < q["tokens"] - MIN_VIEW_TOKENS, q
    assert views["meta_info"]["kvshare"]["view_tokens"] == q["tokens"] - q["corrected_rows"]
    assert copy["meta_info"]["kvshare"]["view_tokens"] == 0
    assert copy["meta_info"]["kvshare"]["segments"][1]["corrected_rows"] == q["corrected_rows"]
    assert views["output_ids"] == copy["output_ids"]


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


def test_soak_with_evictions_leaks_no_slot(tmp_path, tiny_model):
    """The soak benchmark's short version: 100 requests, mixed methods, clients that leave, a
    pool small enough that sources are evicted under their readers."""
    from benchmarks.kv_views_soak import check, soak

    server = kvshare_server(tiny_model, tmp_path / "server.log", "--max-total-tokens", "3000")
    try:
        res = soak(server, 100, seed=1)
        assert server.proc.poll() is None, server.log_tail()
    finally:
        server.stop()
    assert check(res) == [], res
    assert res["ok"] >= 70 and res["left"] >= 1, res
