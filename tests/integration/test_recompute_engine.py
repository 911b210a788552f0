"""Selective recomputation inside the engine (tiny random-weight Llama with 6 layers, so that
layers past CacheBlend's two check layers exist): endpoints, token-layer counts, batching, LoRA."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from sglang_kvshare.testing.server import kvshare_server
from sglang_kvshare.testing.tiny_model import build_tiny_adapter, build_tiny_llama
from sglang_kvshare.testing.workflows import payload, segments

METHODS = ("cacheblend", "droidspeak", "relaycaching")
NUM_LAYERS = 6
CHECK_LAYERS = 2
# DroidSpeak's offline profile: layers 3 and 4 deviate most, so at ratio 1/3 the group is [3, 5)
# and the segment re-enters at layer 3 from the stored hidden state
PROFILE = [0.0, 0.1, 0.2, 1.0, 1.0, 0.1]
LORA_AGENTS = ("solver", "critic")


@pytest.fixture(scope="module")
def deep_model(tmp_path_factory, smollm2_path):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny6"), smollm2_path, num_layers=NUM_LAYERS)


@pytest.fixture(scope="module")
def server(tmp_path_factory, deep_model):
    d = tmp_path_factory.mktemp("recompute")
    (d / "profile.json").write_text(json.dumps({"layer_deviation": PROFILE}))
    srv = kvshare_server(
        deep_model,
        d / "server.log",
        "--kvshare-dump-dir",
        str(d / "dumps"),
        "--kvshare-droidspeak-profile",
        str(d / "profile.json"),
    )
    srv.dump_dir = d / "dumps"
    yield srv
    srv.stop()


def _run(server, wf, method, agents=("solver", "critic", "final"), **extra):
    outputs, results = {}, []
    for agent in agents:
        r = server.generate(payload(wf, agent, method, segments(agent, outputs), 6, **extra))
        assert r.status_code == 200, r.text
        out = r.json()
        results.append(out)
        outputs[agent] = out["text"]
    return results


def _kv(server, wf, agent="critic", slot="q"):
    from sglang_kvshare.integration.cache.radix import _safe

    return torch.load(server.dump_dir / _safe(wf) / _safe(agent) / f"{_safe(slot)}.pt")


def _rel_err(a, b) -> float:
    num = (a["k"] - b["k"]).square().sum() + (a["v"] - b["v"]).square().sum()
    return float((num / (b["k"].square().sum() + b["v"].square().sum())).sqrt())


def _shared(meta):
    return [s for s in meta["segments"] if s["shared"]]


@pytest.mark.parametrize("method", METHODS)
def test_ratio_one_is_nonshared_and_ratio_zero_is_fullshared(server, method):
    dense = _run(server, f"dense-{method}", "nonshared")
    full = _run(server, f"full-{method}", "fullshared")
    one = _run(server, f"one-{method}", method, recompute_ratio=1.0)
    zero = _run(server, f"zero-{method}", method, recompute_ratio=0.0)
    assert [o["output_ids"] for o in one] == [o["output_ids"] for o in dense]
    assert [o["output_ids"] for o in zero] == [o["output_ids"] for o in full]
    assert _rel_err(_kv(server, f"one-{method}"), _kv(server, f"dense-{method}")) < 1e-5
    assert _rel_err(_kv(server, f"zero-{method}"), _kv(server, f"full-{method}")) == 0.0
    for o in one[1:]:
        segs = _shared(o["meta_info"]["kvshare"])
        assert all(s["mode"] == "recomputed" and s["recompute_ratio"] == 1.0 for s in segs)
        assert all(s["recomputed_token_layers"] == s["token_layers"] == NUM_LAYERS * s["source_tokens"] for s in segs)
        assert segs[0]["source_tokens"] == segs[0]["tokens"]  # the question: all of it
    for o in zero[1:]:
        meta = o["meta_info"]["kvshare"]
        assert all(s["mode"] == "injected" for s in _shared(meta))
        assert meta["recomputed_token_layers"] == 0


@pytest.mark.parametrize("method,ratio", [("cacheblend", 0.3), ("droidspeak", 1 / 3), ("relaycaching", 0.3)])
def test_partial_recomputation_runs_the_planned_token_layers(server, method, ratio):
    from sglang_kvshare.recompute import num_selected

    _run(server, f"pdense-{method}", "nonshared", ("solver", "critic"))
    _run(server, f"pfull-{method}", "fullshared", ("solver", "critic"))
    critic = _run(server, f"part-{method}", method, ("solver", "critic"), recompute_ratio=ratio)[1]
    q = _shared(critic["meta_info"]["kvshare"])[0]
    n = q["tokens"]
    assert q["mode"] == "recomputed" and q["source_agent"] == "solver" and q["source_tokens"] == n
    assert q["token_layers"] == NUM_LAYERS * n
    expected = {
        # check layers for every token, then the top-deviation tokens in the other layers
        "cacheblend": CHECK_LAYERS * n + num_selected(ratio, n) * (NUM_LAYERS - CHECK_LAYERS),
        # every token in the profiled group [3, 5), entering from the stored hidden state
        "droidspeak": 2 * n,
        # check layers, then exactly ratio * n * L token-layers in the middle range
        "relaycaching": CHECK_LAYERS * n + num_selected(ratio, n * NUM_LAYERS),
    }[method]
    assert q["recomputed_token_layers"] == expected < q["token_layers"]
    if method == "droidspeak":
        assert q["layer_groups"] == [[3, 5]]
    if method == "relaycaching":
        assert q["layer_groups"] == [[2, 4]]  # the middle third, widened to hold the budget
    # recomputing part of the segment brings its cache closer to the dense one
    dense = _kv(server, f"pdense-{method}")
    assert _rel_err(_kv(server, f"part-{method}"), dense) < _rel_err(_kv(server, f"pfull-{method}"), dense)


def test_relaycaching_without_a_stored_hidden_state_computes_densely(server):
    # the solver's output was decoded, not prefilled: no hidden state of it is stored
    final = _run(server, "relay-out", "relaycaching", recompute_ratio=0.3)[2]
    by_slot = {s["slot"]: s for s in _shared(final["meta_info"]["kvshare"])}
    assert by_slot["out:critic"]["mode"] == "computed"
    assert by_slot["out:critic"]["reason"] == "no_hidden_state"
    assert by_slot["out:critic"]["recomputed_token_layers"] == by_slot["out:critic"]["token_layers"]


def test_recomputing_requests_batched_together_answer_as_alone(server):
    methods = ("cacheblend", "relaycaching", "droidspeak", "nonshared")
    solver_text = {}
    for m in methods:
        for wf in (f"alone-{m}", f"batch-{m}"):
            solver_text[wf] = _run(server, wf, m, ("solver",))[0]["text"]

    def critic(m, wf):
        segs = segments("critic", {"solver": solver_text[wf]})
        r = server.generate(payload(wf, "critic", m, segs, 6, recompute_ratio=0.5))
        assert r.status_code == 200, r.text
        return r.json()

    alone = {m: critic(m, f"alone-{m}") for m in methods}
    with ThreadPoolExecutor(len(methods)) as pool:
        together = dict(zip(methods, pool.map(lambda m: critic(m, f"batch-{m}"), methods)))
    for m in methods:
        assert together[m]["output_ids"] == alone[m]["output_ids"], m
        got = together[m]["meta_info"]["kvshare"].get("recomputed_token_layers")
        assert got == alone[m]["meta_info"]["kvshare"].get("recomputed_token_layers"), m


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory, deep_model):
    d = tmp_path_factory.mktemp("recompute-lora")
    paths = [f"{a}={build_tiny_adapter(deep_model, d / a, seed=i + 1)}" for i, a in enumerate(LORA_AGENTS)]
    srv = kvshare_server(
        deep_model,
        d / "server.log",
        "--enable-lora",
        "--lora-paths",
        *paths,
        "--lora-backend",
        "torch_native",
        "--max-loras-per-batch",
        "4",
    )
    yield srv
    srv.stop()


def _lora_turn(server, wf, agent, method, outputs, **extra):
    body = payload(wf, agent, method, segments(agent, outputs, system="You are one agent of a team."), 6, **extra)
    body["lora_path"] = agent
    r = server.generate(body)
    assert r.status_code == 200, r.text
    return r.json()


def _lora_workflow(server, wf, method, **extra):
    outputs, results = {}, []
    for agent in LORA_AGENTS:
        results.append(_lora_turn(server, wf, agent, method, outputs, **extra))
        outputs[agent] = results[-1]["text"]
    return results


@pytest.mark.parametrize("method", METHODS)
def test_lora_agents_recompute_under_their_own_adapter(lora_server, method):
    from sglang_kvshare.recompute import num_selected

    dense = _lora_workflow(lora_server, f"lora-dense-{method}", "nonshared")
    one = _lora_workflow(lora_server, f"lora-one-{method}", method, recompute_ratio=1.0)
    assert [o["output_ids"] for o in one] == [o["output_ids"] for o in dense]
    # a recomputing critic (no ratio given: the papers' 30% for LoRA agents) batched with a
    # nonshared critic: the narrowed LoRA rows must not disturb the other request's adapter
    wf = f"lora-part-{method}"
    solver = _lora_turn(lora_server, wf, "solver", method, {})
    _lora_turn(lora_server, wf + "-dense", "solver", "nonshared", {})
    with ThreadPoolExecutor(2) as pool:
        part, plain = pool.map(
            lambda a: _lora_turn(lora_server, *a),
            [
                (wf, "critic", method, {"solver": solver["text"]}),
                (wf + "-dense", "critic", "nonshared", {"solver": solver["text"]}),
            ],
        )
    assert plain["output_ids"] == dense[1]["output_ids"]
    q = _shared(part["meta_info"]["kvshare"])[0]
    n = q["tokens"]
    assert q["mode"] == "recomputed" and q["recompute_ratio"] == 0.3 and q["source_agent"] == "solver"
    expected = {
        "cacheblend": CHECK_LAYERS * n + num_selected(0.3, n) * (NUM_LAYERS - CHECK_LAYERS),
        "droidspeak": num_selected(0.3, NUM_LAYERS) * n,  # no profile: one group of 2 layers
        "relaycaching": CHECK_LAYERS * n + num_selected(0.3, n * NUM_LAYERS),
    }[method]
    assert q["recomputed_token_layers"] == expected


def test_budget_defaults_follow_the_papers():
    from sglang_kvshare.integration.scheduler.recompute_jobs import recompute_ratio

    assert recompute_ratio(None, -1.0, lora=False) == 0.1  # rho 0.9, system-prompt agents
    assert recompute_ratio(None, -1.0, lora=True) == 0.3  # PReCache: 30% for LoRA agents
    assert recompute_ratio(None, 0.25, lora=True) == 0.25  # --kvshare-recompute-ratio
    assert recompute_ratio(0.0, 0.25, lora=False) == 0.0  # the request's own budget wins
