"""The real default model (SmolLM2-135M-Instruct) through the plugin and through stock SGLang."""

import pytest

from tests.integration.server import kvshare_server, running, stock_server
from tests.integration.workflow_helpers import payload, run_workflow, segments

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def servers(tmp_path_factory, smollm2_path):
    d = tmp_path_factory.mktemp("smollm2")
    with running(
        lambda: kvshare_server(smollm2_path, d / "ours.log"),
        lambda: stock_server(smollm2_path, d / "stock.log"),
    ) as (ours, stock):
        yield ours, stock


def test_nonshared_is_token_identical_to_stock_sglang(servers, smollm2_path):
    from transformers import AutoTokenizer

    ours, stock = servers
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    for agent, outputs in (("solver", {}), ("critic", {"solver": "Box 5 holds 15 red apples."})):
        segs = segments(agent, outputs)
        r = ours.generate(payload(f"smol-{agent}", agent, "nonshared", segs, 24))
        assert r.status_code == 200, r.text
        ids = [t for s in segs for t in tok.encode(s["text"], add_special_tokens=False)]
        s = stock.generate({"input_ids": ids, "sampling_params": {"max_new_tokens": 24, "temperature": 0}})
        assert s.status_code == 200, s.text
        assert r.json()["output_ids"] == s.json()["output_ids"]
        assert r.json()["meta_info"]["kvshare"]["prompt_tokens"] == len(ids)


def test_the_answer_is_coherent_and_reuse_skips_the_question(servers):
    ours, _ = servers
    shared = run_workflow(ours, "smol-flow", "fullshared", max_new_tokens=16)
    assert "15" in shared[0]["text"] or "apple" in shared[0]["text"].lower()
    meta = shared[1]["meta_info"]["kvshare"]
    assert meta["segments"][1]["mode"] == "injected"
    assert meta["computed_tokens"] < meta["prompt_tokens"] // 4
