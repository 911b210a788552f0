"""PReCache's key LR cache in the engine: adapters on k_proj (QKVO) under ``--kvshare-lr-cache``.

Tiny random Llama, three random adapters on q/k/v/o (the actor's also on the MLP), the same
growing round-robin trajectory as ``test_precache_engine``. The stock server (SGLang LoRA) also
loads the planner's adapter without its k_proj weights: the negative control that shows the key
delta changes the tokens, so matching stock is a test of the key LR path.
"""

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from sglang_kvshare.testing.server import kvshare_server, running, stock_server
from sglang_kvshare.testing.tiny_model import build_tiny_adapter, build_tiny_llama, without_module
from tests.integration.test_precache_engine import AGENTS, ask, stock_generate, stock_ids

QKVO = ("q_proj", "k_proj", "v_proj", "o_proj")
TARGETS = {"planner": QKVO, "actor": QKVO + ("gate_proj", "up_proj", "down_proj"), "reflector": QKVO}
RANK = 4
B_STD = 0.15


@pytest.fixture(scope="module")
def qkvo_servers(tmp_path_factory, tiny_model):
    d = tmp_path_factory.mktemp("qkvo")
    dirs = {
        a: build_tiny_adapter(tiny_model, d / a, seed=30 + i, rank=RANK, targets=TARGETS[a], b_std=B_STD)
        for i, a in enumerate(AGENTS)
    }
    paths = [f"{a}={p}" for a, p in dirs.items()]
    no_k = f"planner-nok={without_module(dirs['planner'], d / 'planner-nok', 'k_proj')}"
    common = ["--enable-lora", "--lora-backend", "torch_native", "--lora-paths"]
    with running(
        lambda: kvshare_server(
            tiny_model,
            d / "ours.log",
            *common,
            *paths,
            "--max-loras-per-batch",
            "4",
            "--kvshare-lr-cache",
            "--kvshare-dump-dir",
            str(d / "dumps"),
        ),
        lambda: stock_server(
            tiny_model, d / "stock.log", *common, *paths, no_k, "--max-loras-per-batch", "5", plugin=True
        ),
    ) as (ours, stock):
        ours.dump_dir = d / "dumps"
        yield ours, stock


def test_qkvo_nonshared_matches_stock_lora(qkvo_servers, tiny_model):
    """nonshared with the key and value LR terms = stock SGLang LoRA, one adapter per request and
    a mixed batch; without k_proj the planner's tokens differ (the key delta matters)."""
    from transformers import AutoTokenizer

    ours, stock = qkvo_servers
    tok = AutoTokenizer.from_pretrained(tiny_model)
    ids = stock_ids(tok, 3)
    for agent in AGENTS:
        out = ask(ours, f"qkvo-{agent}", "nonshared", 3, agent=agent, max_new_tokens=12)
        assert out["output_ids"] == stock_generate(stock, ids, agent, 12), agent
        # value and key columns: 2 x layers x rank x float32
        kv = out["meta_info"]["kvshare"]
        assert kv["lr_bytes_per_token_per_agent"] == 2 * 2 * RANK * 4
        assert kv["pool_cell_bytes_per_token"] == (
            kv["kv_bytes_per_token"] + 4 * kv["lr_bytes_per_token_per_agent"] + kv["lp_stash_bytes_per_token"]
        )
        # and the LP stash's room: one more column (--kvshare-lp-stash-columns 1, the default)
        assert kv["lp_stash_bytes_per_token"] == kv["lr_bytes_per_token_per_agent"]
    assert stock_generate(stock, ids, "planner-nok", 12) != stock_generate(stock, ids, "planner", 12)
    with ThreadPoolExecutor(3) as pool:
        outs = list(
            pool.map(lambda a: ask(ours, f"qkvo-mixed-{a}", "nonshared", 4, agent=a, max_new_tokens=12), AGENTS)
        )
    ids = stock_ids(tok, 4)
    for agent, out in zip(AGENTS, outs):
        assert out["output_ids"] == stock_generate(stock, ids, agent, 12), agent


@pytest.mark.parametrize("method", ["rebase_shared_db", "rebase_shared_lp"])
def test_rebase_keeps_the_agents_own_key_and_value_columns(qkvo_servers, method):
    """QKVO under ReBaseShared: agent j's own key AND value LR columns of its turn's tokens come
    from its adapted states (as an adapted prefill writes them), every other agent's from the
    adapter-free states (as a base-model prefill writes them); read back from the tree by a later
    base-model request's dump. The two references differ in column j (so a column j rebuilt from
    adapter-free states fails)."""
    ours, _ = qkvo_servers
    wf, j = f"qkvo-own-{method}", "planner"
    ask(ours, wf, method, 1, agent=j)
    ask(ours, wf, method, 2, agent="reflector", lora=False)
    got = torch.load(ours.dump_dir / wf / "reflector" / "turn0.pt")
    refs = {}
    for name, lora in (("adapted", True), ("neutral", False)):
        ask(ours, f"{wf}-{name}", "nonshared", 1, agent=j, lora=lora)
        refs[name] = torch.load(ours.dump_dir / f"{wf}-{name}" / j / "turn0.pt")
    cols = got["lr_columns"]
    assert set(cols) == set(AGENTS) and got["token_ids"] == refs["adapted"]["token_ids"]

    def close(a, b):
        return torch.allclose(a, b, rtol=1e-4, atol=1e-5)

    for kind in ("lr_k", "lr_v"):
        for agent, c in cols.items():
            want = refs["adapted" if agent == j else "neutral"][kind][:, :, c]
            assert close(got[kind][:, :, c], want), (kind, agent)
        assert not close(refs["adapted"][kind][:, :, cols[j]], refs["neutral"][kind][:, :, cols[j]]), kind


def test_prelr_reusing_its_own_context_is_exact(qkvo_servers, tiny_model):
    """An agent whose cached context it computed itself: prelr_shared reads base K/V and its own
    key/value LR columns of the cached prefix (key deltas rotated at their positions) and gives
    stock LoRA's tokens on the whole prompt."""
    from transformers import AutoTokenizer

    ours, stock = qkvo_servers
    tok = AutoTokenizer.from_pretrained(tiny_model)
    first = ask(ours, "qkvo-solo", "prelr_shared", 3, agent="actor", max_new_tokens=4)
    again = ask(ours, "qkvo-solo", "prelr_shared", 5, agent="actor", max_new_tokens=10)
    meta = again["meta_info"]["kvshare"]
    assert meta["computed_tokens"] <= meta["prompt_tokens"] - first["meta_info"]["kvshare"]["prompt_tokens"] + 2
    assert again["output_ids"] == stock_generate(stock, stock_ids(tok, 5), "actor", 10)


@pytest.fixture(scope="module")
def one_layer_server(tmp_path_factory, smollm2_path):
    """A one-layer model: every agent's layer input is the embedding, so the LR columns PreLRShared
    precomputes for agent j from another agent's turn are exactly j's own."""
    d = tmp_path_factory.mktemp("qkvo-1l")
    model = build_tiny_llama(d / "model", smollm2_path, num_layers=1)
    dirs = {
        a: build_tiny_adapter(model, d / a, seed=40 + i, rank=RANK, targets=TARGETS[a], b_std=B_STD)
        for i, a in enumerate(AGENTS)
    }
    no_k = without_module(dirs["planner"], d / "planner-nok", "k_proj")
    server = kvshare_server(
        model,
        d / "ours.log",
        "--enable-lora",
        "--lora-backend",
        "torch_native",
        "--lora-paths",
        *[f"{a}={p}" for a, p in dirs.items()],
        f"planner-nok={no_k}",
        "--max-loras-per-batch",
        "5",
        "--kvshare-lr-cache",
    )
    yield server
    server.stop()


def test_prelr_serves_later_agents_from_precomputed_key_and_value_columns(one_layer_server):
    """Round robin: each later agent computes only its turn's new tokens and attends the earlier
    agents' base K/V with its own precomputed key and value LR columns; on one layer that is
    exactly nonshared's output."""
    ours = one_layer_server
    turns = 6
    runs = {
        m: [ask(ours, f"qkvo-rr-{m}", m, t, max_new_tokens=8) for t in range(turns)]
        for m in ("nonshared", "prelr_shared")
    }
    prompt = [r["meta_info"]["kvshare"]["prompt_tokens"] for r in runs["nonshared"]]
    for t in range(1, turns):
        pre = runs["prelr_shared"][t]["meta_info"]["kvshare"]
        assert pre["computed_tokens"] <= prompt[t] - prompt[t - 1], t  # only the turn's new tokens
        assert runs["prelr_shared"][t]["output_ids"] == runs["nonshared"][t]["output_ids"], t
    # the key delta acts on this model too: the planner without k_proj answers otherwise
    no_k = ask(ours, "qkvo-nok", "nonshared", 3, agent="planner", lora=False, lora_path="planner-nok", max_new_tokens=8)
    assert no_k["output_ids"] != runs["nonshared"][3]["output_ids"]


def test_unservable_adapter_is_a_startup_error_naming_it(tmp_path, tiny_model):
    bad = build_tiny_adapter(tiny_model, tmp_path / "bad", seed=1, targets=("q_proj", "k_proj", "gate_proj"))
    cfg = Path(bad) / "adapter_config.json"
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "rank_pattern": {"k_proj": 2}}))
    with pytest.raises(RuntimeError, match="server exited") as err:
        kvshare_server(
            tiny_model,
            tmp_path / "bad.log",
            "--enable-lora",
            "--lora-backend",
            "torch_native",
            "--lora-paths",
            f"critic={bad}",
            "--kvshare-lr-cache",
            timeout=120,
            starts=1,
        )
    assert "adapter 'critic' cannot be served with --kvshare-lr-cache" in str(err.value)
    assert "rank_pattern" in str(err.value)
