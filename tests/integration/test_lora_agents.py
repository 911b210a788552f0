"""Agents that differ by LoRA adapter (per-request ``lora_path``) through the plugin."""

import pytest

from sglang_kvshare.testing.server import kvshare_server, running, stock_server
from sglang_kvshare.testing.tiny_model import build_tiny_adapter
from sglang_kvshare.testing.workflows import payload, private_tokens, segments

AGENTS = ("solver", "critic")
SYSTEM = "You are one agent of a team."


@pytest.fixture(scope="module")
def lora_servers(tmp_path_factory, tiny_model):
    d = tmp_path_factory.mktemp("lora")
    paths = [f"{a}={build_tiny_adapter(tiny_model, d / a, seed=i + 1)}" for i, a in enumerate(AGENTS)]
    flags = ["--enable-lora", "--lora-paths", *paths, "--lora-backend", "torch_native", "--max-loras-per-batch", "4"]
    with running(
        lambda: kvshare_server(tiny_model, d / "ours.log", *flags),
        lambda: stock_server(tiny_model, d / "stock.log", *flags, plugin=True),
    ) as (ours, stock):
        yield ours, stock


def _turn(server, wf, agent, method, outputs):
    body = payload(wf, agent, method, segments(agent, outputs, system=SYSTEM), 8)
    body["lora_path"] = agent
    r = server.generate(body)
    assert r.status_code == 200, r.text
    return r.json()


def test_lora_agents_nonshared_match_stock_lora(lora_servers, tiny_model):
    from transformers import AutoTokenizer

    ours, stock = lora_servers
    tok = AutoTokenizer.from_pretrained(tiny_model)
    outputs = {}
    for agent in AGENTS:
        out = _turn(ours, "lora-dense", agent, "nonshared", outputs)
        segs = segments(agent, outputs, system=SYSTEM)
        ids = [t for s in segs for t in tok.encode(s["text"], add_special_tokens=False)]
        ref = stock.generate(
            {"input_ids": ids, "lora_path": agent, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
        )
        assert ref.status_code == 200, ref.text
        assert out["output_ids"] == ref.json()["output_ids"]
        outputs[agent] = out["text"]
    # the adapters act: the same prompt without an adapter gives other tokens
    base = stock.generate({"input_ids": ids, "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
    assert base.json()["output_ids"] != out["output_ids"]


def test_fullshared_reuses_the_previous_agents_cache_across_adapters(lora_servers):
    ours, _ = lora_servers
    first = _turn(ours, "lora-shared", "solver", "fullshared", {})
    second = _turn(ours, "lora-shared", "critic", "fullshared", {"solver": first["text"]})
    meta = second["meta_info"]["kvshare"]
    ph = [s for s in meta["segments"] if s["shared"]]
    assert all(s["mode"] == "injected" and s["source_agent"] == "solver" for s in ph)
    missing = sum(s["tokens"] - s["injected_tokens"] for s in ph)
    assert meta["computed_tokens"] == private_tokens(meta) + missing


def test_unknown_adapter_is_a_clear_error_and_the_server_keeps_serving(lora_servers):
    ours, _ = lora_servers
    body = payload("lora-bad", "solver", "fullshared", segments("solver", {}, system=SYSTEM), 2)
    body["lora_path"] = "no-such-adapter"
    r = ours.generate(body)
    assert r.status_code == 400 and "no-such-adapter" in r.text
    assert _turn(ours, "lora-ok", "solver", "nonshared", {})["meta_info"]["kvshare"]["computed_tokens"] > 0
