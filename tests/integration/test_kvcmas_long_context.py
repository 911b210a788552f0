"""KVCMAS at ~2K shared tokens on the real default model, the way a server meets it: a server that
first served other workflows (other roles, shorter contexts, other correction methods), a short
warm-up, then every later agent's question is corrected; its anchors survive a restart."""

from __future__ import annotations

import pytest
import requests

from sglang_kvshare.testing.server import kvshare_server
from sglang_kvshare.testing.workflows import settle

pytestmark = pytest.mark.slow

CONTEXT = 2048


@pytest.fixture(scope="module")
def tok(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


def _workflow(server, tok, wf: str, method: str, context: int, prefix: str = "", **extra) -> list[dict]:
    """solver -> critic -> final (the serving benchmark's roles), each with its own system prompt."""
    from benchmarks.serving.workload import make_context
    from sglang_kvshare.testing.workflows import make_roles
    from sglang_kvshare.workflows import build_payload, build_segments

    task, final = make_roles(3, prefix=prefix)
    roles, outs, metas = task + [final], [], []
    ctx = make_context(tok, context, wf)
    for i, role in enumerate(roles):
        reads = [(roles[j].name, roles[j].title, outs[j]) for j in range(i)]
        p = build_payload(role, build_segments(role, ctx, reads), wf, method, 8)
        p["kvshare"].update(extra)
        r = server.generate(p, timeout=600)
        assert r.status_code == 200, r.text
        outs.append(r.json()["text"])
        metas.append(r.json()["meta_info"]["kvshare"])
    settle(server)
    return metas


def _question(meta: dict) -> dict:
    return next(s for s in meta["segments"] if s.get("slot") == "q")


def test_a_long_lived_server_corrects_long_contexts_after_a_short_warm_up(tmp_path, smollm2_path, tok):
    pool_file = tmp_path / "anchors.pt"
    server = kvshare_server(smollm2_path, tmp_path / "server.log", "--kvshare-anchor-pool", str(pool_file))
    try:
        # a server that has been up: other roles, 300-400-token contexts, every correction method
        for k, method in enumerate(("kvcmas", "kvcmas_plus", "kvcomm", "graphflow") * 2):
            _workflow(server, tok, f"other-{k}", method, 300 + 100 * (k % 2), prefix="other_")
        # warm-up: two workflows of the new roles; each later agent falls back once per workflow
        for w in range(2):
            for meta in _workflow(server, tok, f"warm-{w}", "kvcmas", CONTEXT)[1:]:
                assert _question(meta)["mode"] == "dense_fallback"
        # from the third workflow on, every later agent's 2K question has two compatible anchors
        for w in range(2):
            metas = _workflow(server, tok, f"run-{w}", "kvcmas", CONTEXT, tau=1.0)
            for meta in metas[1:]:
                q = _question(meta)
                assert q["tokens"] >= CONTEXT - 8
                assert q["mode"] == "corrected" and q["anchors"] >= 2, q
                # one anchor (fp16 rank-32 factors and its value base) is ~0.2x the fp32 KV per token
                assert 0 < q["anchor_bytes_per_token"] < meta["kv_bytes_per_token"] / 4
                assert meta["correction_ms"] > 0
                assert meta["computed_tokens"] < meta["prompt_tokens"] - CONTEXT + 64
        state = settle(server)
        assert state["anchor_bytes"] <= state["anchor_budget_bytes"]
        anchors = state["correctors"]["kvcmas"]["num_anchors"]
        saved = requests.post(
            server.url + "/set_internal_state", json={"server_args": {"kvshare_save_anchor_pool": 1}}, timeout=120
        )
        assert saved.status_code == 200 and pool_file.stat().st_size > 0
    finally:
        server.stop()
    # warm start: a restarted server corrects from its first workflow
    server = kvshare_server(smollm2_path, tmp_path / "restarted.log", "--kvshare-anchor-pool", str(pool_file))
    try:
        assert settle(server)["correctors"]["kvcmas"]["num_anchors"] == anchors
        for meta in _workflow(server, tok, "after-restart", "kvcmas", CONTEXT, tau=1.0)[1:]:
            assert _question(meta)["mode"] == "corrected"
    finally:
        server.stop()
