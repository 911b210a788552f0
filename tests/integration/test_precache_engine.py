"""PReCache in the engine (``--kvshare-lr-cache``): LoRA agents sharing one base cache plus LR caches.

A three-agent round-robin over a growing trajectory (fixed observations appended turn by turn,
so every prompt extends the previous one) on the tiny model with three random q/v adapters.
"""

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from sglang_kvshare.testing.server import kvshare_server, running, stock_server
from sglang_kvshare.testing.tiny_model import build_tiny_adapter

AGENTS = ("planner", "actor", "reflector")
HEADER = (
    "<|im_start|>system\nA team of agents works on one task. Task: "
    + " ".join(f"step {i} moves crate {i} to shelf {i % 4}." for i in range(20))
    + "<|im_end|>\n"
)
OBS = [f"Observation {t}: " + " ".join(f"item {t}-{i} is ready." for i in range(6 + t)) for t in range(8)]


@pytest.fixture(scope="module")
def lr_servers(tmp_path_factory, tiny_model):
    d = tmp_path_factory.mktemp("precache")
    paths = [f"{a}={build_tiny_adapter(tiny_model, d / a, seed=10 + i)}" for i, a in enumerate(AGENTS)]
    flags = ["--enable-lora", "--lora-paths", *paths, "--lora-backend", "torch_native", "--max-loras-per-batch", "4"]
    with running(
        # priority scheduling: rebase_shared_lp queues its rebuild at the lowest priority
        lambda: kvshare_server(
            tiny_model,
            d / "ours.log",
            *flags,
            "--kvshare-lr-cache",
            "--enable-priority-scheduling",
            "--kvshare-dump-dir",
            str(d / "dumps"),
        ),
        lambda: stock_server(tiny_model, d / "stock.log", *flags, plugin=True),
    ) as (ours, stock):
        ours.dump_dir = d / "dumps"
        yield ours, stock


def turn_segments(t: int) -> list[dict]:
    segs = [{"text": HEADER, "shared": False}]
    for s in range(t):
        segs.append({"text": f"<|im_start|>{AGENTS[s % 3]}\n{OBS[s]}<|im_end|>\n", "shared": True, "slot": f"turn{s}"})
    segs.append({"text": f"<|im_start|>{AGENTS[t % 3]}\n", "shared": False})
    return segs


def ask(server, wf, method, t, agent=None, lora=True, max_new_tokens=6, **extra):
    agent = agent or AGENTS[t % 3]
    body = {
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0},
        "kvshare": {"workflow": wf, "agent": agent, "method": method, "segments": turn_segments(t)},
        **extra,
    }
    if lora:
        body["lora_path"] = agent
    r = server.generate(body)
    assert r.status_code == 200, r.text
    return r.json()


def stock_ids(tok, t):
    return [i for s in turn_segments(t) for i in tok.encode(s["text"], add_special_tokens=False)]


def stock_generate(stock, ids, lora, max_new_tokens=6):
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}}
    if lora:
        body["lora_path"] = lora
    r = stock.generate(body)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def test_lr_split_attention_matches_stock_lora(lr_servers, tiny_model):
    """nonshared under the LR cache (v delta as P V_base + (P LR) B) = stock LoRA, one adapter
    per request and a mixed batch of all three."""
    from transformers import AutoTokenizer

    ours, stock = lr_servers
    tok = AutoTokenizer.from_pretrained(tiny_model)
    ids = stock_ids(tok, 3)
    for agent in AGENTS:
        out = ask(ours, f"split-{agent}", "nonshared", 3, agent=agent, max_new_tokens=12)
        assert out["output_ids"] == stock_generate(stock, ids, agent, 12), agent
        kv = out["meta_info"]["kvshare"]
        assert kv["lr_bytes_per_token_per_agent"] > 0
        # SGLang sized the pool with the LR bytes of all 4 columns and the LP stash beside the KV bytes
        assert kv["pool_cell_bytes_per_token"] == (
            kv["kv_bytes_per_token"] + 4 * kv["lr_bytes_per_token_per_agent"] + kv["lp_stash_bytes_per_token"]
        )
        # and the LP stash's room: one more column (--kvshare-lp-stash-columns 1, the default)
        assert kv["lp_stash_bytes_per_token"] == kv["lr_bytes_per_token_per_agent"]
    with ThreadPoolExecutor(3) as pool:
        outs = list(pool.map(lambda a: ask(ours, f"mixed-{a}", "nonshared", 4, agent=a, max_new_tokens=12), AGENTS))
    ids = stock_ids(tok, 4)
    for agent, out in zip(AGENTS, outs):
        assert out["output_ids"] == stock_generate(stock, ids, agent, 12), agent
    # the adapters act: the base model gives other tokens
    assert stock_generate(stock, ids, None, 12) not in [o["output_ids"] for o in outs]


def _round_robin(server, method, turns=6):
    return [ask(server, f"rr-{method}", method, t)["meta_info"]["kvshare"] for t in range(turns)]


def test_computed_tokens_in_a_round_robin(lr_servers):
    ours, _ = lr_servers
    runs = {
        m: _round_robin(ours, m)
        for m in ("nonshared", "baseshared", "prelr_shared", "rebase_shared_lp", "rebase_shared_db")
    }
    prompt = [m["prompt_tokens"] for m in runs["nonshared"]]
    for method, metas in runs.items():
        assert [m["prompt_tokens"] for m in metas] == prompt, method
        assert metas[0]["computed_tokens"] == prompt[0], method
    for t in range(1, 6):
        new = prompt[t] - prompt[t - 1]
        # PreLRShared / ReBaseShared: only the turn's new tokens
        assert runs["prelr_shared"][t]["computed_tokens"] <= new, t
        assert runs["rebase_shared_lp"][t]["computed_tokens"] <= new, t
        assert runs["rebase_shared_db"][t]["computed_tokens"] <= new, t
        # LRAgent and no sharing: the shared context the agent has not processed itself
        assert runs["baseshared"][t]["computed_tokens"] == runs["nonshared"][t]["computed_tokens"], t
        unseen = prompt[t] - (prompt[t - 3] if t >= 3 else 0)
        assert runs["nonshared"][t]["computed_tokens"] >= unseen - 6, t
        assert runs["nonshared"][t]["computed_tokens"] > 2 * new, t
    # ReBaseShared: each adapted turn's new tokens (prompt and fed output) are computed once more
    # without an adapter, beside it in the same batches (DB: counted in its answer) or queued after
    # it (LP: counted in the workflow's next request, which reads the rebuilt cache)
    rebuilt = [(m["rebuild_tokens"], m["computed_tokens"]) for m in runs["rebase_shared_db"]]
    assert all(r >= c for r, c in rebuilt) and any(r > c for r, c in rebuilt), rebuilt
    lp = [m["rebuild_tokens"] for m in runs["rebase_shared_lp"]]
    assert lp == [0] + [r for r, _ in rebuilt[:-1]]


def test_baseshared_equals_nonshared_when_the_agent_produced_the_context(lr_servers, tiny_model):
    from transformers import AutoTokenizer

    ours, stock = lr_servers
    tok = AutoTokenizer.from_pretrained(tiny_model)
    for t in (0, 3):  # the same agent twice; its second prompt extends its first
        base = ask(ours, "solo-base", "baseshared", t, agent="planner", max_new_tokens=10)
        dense = ask(ours, "solo-dense", "nonshared", t, agent="planner", max_new_tokens=10)
        assert base["output_ids"] == dense["output_ids"] == stock_generate(stock, stock_ids(tok, t), "planner", 10)
    assert base["meta_info"]["kvshare"]["computed_tokens"] < base["meta_info"]["kvshare"]["prompt_tokens"]


def test_rebase_lp_leaves_the_adapter_free_cache(lr_servers):
    """After ReBaseShared's rebuild, the next agent sees exactly the cache a base-model turn leaves:
    the same outputs as a workflow whose first turns ran without any adapter (PreLR). The adapted
    turn streams (its answer does not wait for the rebuild); the workflow's next request waits for
    the rebuild and is charged with its tokens."""
    ours, _ = lr_servers
    first = ask(ours, "rb-lp", "rebase_shared_lp", 0)
    events = ours.stream(
        {
            "sampling_params": {"max_new_tokens": 6, "temperature": 0},
            "stream": True,
            "lora_path": AGENTS[1],
            "kvshare": {
                "workflow": "rb-lp",
                "agent": AGENTS[1],
                "method": "rebase_shared_lp",
                "segments": turn_segments(1),
            },
        }
    )
    third = ask(ours, "rb-lp", "rebase_shared_lp", 2)
    neutral = [ask(ours, "rb-neutral", "prelr_shared", t, lora=t == 2) for t in range(3)]
    assert third["output_ids"] == neutral[2]["output_ids"]
    assert third["meta_info"]["kvshare"]["computed_tokens"] == neutral[2]["meta_info"]["kvshare"]["computed_tokens"]
    assert len(events) > 2  # streamed token by token
    m0, m1, m2 = first["meta_info"]["kvshare"], events[-1]["meta_info"]["kvshare"], third["meta_info"]["kvshare"]
    assert m0["rebuild_tokens"] == 0
    assert m1["rebuild_tokens"] == m0["computed_tokens"] + len(first["output_ids"]) - 1
    assert m2["rebuild_tokens"] == m1["computed_tokens"] + len(events[-1]["output_ids"]) - 1
    assert m2["rebuild_wait_ms"] >= 0


def test_rebase_db_and_lp_leave_identical_caches(lr_servers):
    """DB's adapter-free twin rebuilds the same cache as LP's post-turn prefill: the next agent
    computes the same tokens and gets the same first-token distribution and greedy output."""
    ours, _ = lr_servers
    logprobs = {"return_logprob": True, "top_logprobs_num": 5}
    runs = {
        m: [ask(ours, f"same-{m}", m, t, **logprobs) for t in range(4)]
        for m in ("rebase_shared_lp", "rebase_shared_db")
    }
    lp, db = runs["rebase_shared_lp"], runs["rebase_shared_db"]
    for t in range(4):
        assert db[t]["output_ids"] == lp[t]["output_ids"], t
        m_lp, m_db = lp[t]["meta_info"], db[t]["meta_info"]
        for key in ("computed_tokens", "cached_tokens"):
            assert m_db["kvshare"][key] == m_lp["kvshare"][key], (t, key)
        # LP's rebuild of turn t is charged to turn t + 1
        assert m_lp["kvshare"]["rebuild_tokens"] == (db[t - 1]["meta_info"]["kvshare"]["rebuild_tokens"] if t else 0), t
        top_lp = {tok: p for p, tok, _ in m_lp["output_top_logprobs"][0]}
        top_db = {tok: p for p, tok, _ in m_db["output_top_logprobs"][0]}
        assert top_db.keys() == top_lp.keys(), t
        assert all(abs(top_db[k] - top_lp[k]) < 1e-4 for k in top_lp), t
    assert db[3]["meta_info"]["kvshare"]["computed_tokens"] < db[3]["meta_info"]["kvshare"]["prompt_tokens"] / 4


def _top_logprobs(out) -> dict:
    return {tok: p for p, tok, _ in out["meta_info"]["output_top_logprobs"][0]}


@pytest.fixture(scope="module")
def own_column_refs(lr_servers):
    """References for agent j = planner's turn over ``turn_segments(1)``: its adapted prefill's
    LR rows (every column from X_j,adpt) and the base model's (every column and the base K/V from
    X_neut), as dumped K/V + LR of slot turn0; and PreLRShared workflows whose first turn ran
    without an adapter (the cache the adapter-free rebuild alone leaves), read by agent k = actor
    and by agent j."""
    ours, _ = lr_servers
    ask(ours, "own-ref-adapted", "nonshared", 1, agent="planner")
    ask(ours, "own-ref-neutral", "nonshared", 1, agent="planner", lora=False)
    dumps = {
        name: torch.load(ours.dump_dir / f"own-ref-{name}" / "planner" / "turn0.pt") for name in ("adapted", "neutral")
    }
    later = {}
    for reader in ("actor", "planner"):
        ask(ours, f"own-ref-{reader}", "prelr_shared", 1, agent="planner", lora=False)
        later[reader] = ask(
            ours, f"own-ref-{reader}", "prelr_shared", 2, agent=reader, return_logprob=True, top_logprobs_num=5
        )
    return dumps, later


@pytest.mark.parametrize("method", ["rebase_shared_db", "rebase_shared_lp"])
def test_rebase_keeps_the_agents_own_lr_column(lr_servers, own_column_refs, method):
    """ReBaseShared as the paper defines it: after agent j's adapted turn the shared context holds
    the neutral base K/V and every other agent's LR column from adapter-free hidden states, and j's
    own LR column from j's adapted states (X_j,adpt A_j, as an adapted prefill writes it). Read
    back from the tree by a later base-model request's dump. Then agent k's later turn is exactly
    the adapter-free rebuild's (k reads no column of j), while agent j's later turn is not: j
    reads its own column, which the adapter-free pass alone would have rebuilt from X_neut."""
    ours, _ = lr_servers
    (refs, later), wf = own_column_refs, f"own-{method}"
    j, others = "planner", ("actor", "reflector")
    ask(ours, wf, method, 1, agent=j)  # j's adapted turn: turn0 is among its new tokens
    reader = ask(ours, wf, method, 2, agent="reflector", lora=False)  # inserted, dumped
    got = torch.load(ours.dump_dir / wf / "reflector" / "turn0.pt")
    adapted, neutral = refs["adapted"], refs["neutral"]
    assert got["token_ids"] == adapted["token_ids"] == neutral["token_ids"] and got["start"] == adapted["start"]
    assert reader["meta_info"]["kvshare"]["cached_tokens"] >= got["start"] + len(got["token_ids"])
    cols = got["lr_columns"]
    assert cols == adapted["lr_columns"] and set(cols) == {j, *others}

    def close(a, b):
        return torch.allclose(a, b, rtol=1e-4, atol=1e-5)

    assert close(got["k"], neutral["k"]) and close(got["v"], neutral["v"])  # the neutral base cache
    for k in others:  # the other agents' columns: from X_neut
        assert close(got["lr_v"][:, :, cols[k]], neutral["lr_v"][:, :, cols[k]]), k
    own = got["lr_v"][:, :, cols[j]]
    # negative control: column j from X_neut (the adapter-free pass alone) is far from X_j,adpt A_j
    assert (adapted["lr_v"][:, :, cols[j]] - neutral["lr_v"][:, :, cols[j]]).abs().max() > 1e-2
    assert not close(own, neutral["lr_v"][:, :, cols[j]])
    assert close(own, adapted["lr_v"][:, :, cols[j]])  # j's own column: from X_j,adpt

    # later turns over that cache (each in a workflow of its own: j's turn, then the reader)
    for reader_agent in ("actor", "planner"):
        w = f"{wf}-{reader_agent}"
        ask(ours, w, method, 1, agent=j)
        out = ask(ours, w, method, 2, agent=reader_agent, return_logprob=True, top_logprobs_num=5)
        ref = later[reader_agent]
        m, m_ref = out["meta_info"]["kvshare"], ref["meta_info"]["kvshare"]
        assert m["cached_tokens"] == m_ref["cached_tokens"], reader_agent
        top, top_ref = _top_logprobs(out), _top_logprobs(ref)
        gap = max(abs(top[t] - top_ref[t]) for t in top_ref) if top.keys() == top_ref.keys() else float("inf")
        if reader_agent == "actor":  # k: unchanged, the adapter-free rebuild's cache
            assert out["output_ids"] == ref["output_ids"] and gap < 1e-4, gap
        else:  # j: its own column differs from the adapter-free one (the negative control)
            assert gap > 1e-3, gap


def test_rebase_db_in_a_concurrent_batch_and_streamed(lr_servers, tiny_model):
    """Three DB agents at once (adapted paths and twins share the batches): each adapted output is
    stock LoRA's; a streamed DB turn answers once, with its rebuild counted."""
    from transformers import AutoTokenizer

    ours, stock = lr_servers
    tok = AutoTokenizer.from_pretrained(tiny_model)
    with ThreadPoolExecutor(3) as pool:
        outs = list(
            pool.map(lambda a: ask(ours, f"conc-{a}", "rebase_shared_db", 2, agent=a, max_new_tokens=8), AGENTS)
        )
    for agent, out in zip(AGENTS, outs):
        assert out["output_ids"] == stock_generate(stock, stock_ids(tok, 2), agent, 8), agent
        meta = out["meta_info"]["kvshare"]
        assert meta["rebuild_tokens"] == meta["computed_tokens"] + len(out["output_ids"]) - 1, agent
    body = {
        "sampling_params": {"max_new_tokens": 8, "temperature": 0},
        "stream": True,
        "lora_path": "actor",
        "kvshare": {
            "workflow": "conc-planner",
            "agent": "actor",
            "method": "rebase_shared_db",
            "segments": turn_segments(3),
        },
    }
    events = ours.stream(body)
    assert events and events[-1]["meta_info"]["kvshare"]["rebuild_tokens"] > 0
    assert events[-1]["meta_info"]["kvshare"]["computed_tokens"] < events[-1]["meta_info"]["prompt_tokens"]


def test_lr_methods_need_the_lr_cache(tiny_server):
    body = {
        "sampling_params": {"max_new_tokens": 2},
        "kvshare": {"workflow": "w", "agent": "a", "method": "prelr_shared", "segments": turn_segments(1)},
    }
    r = tiny_server.generate(body)
    assert r.status_code == 400 and "--kvshare-lr-cache" in r.text
    body["kvshare"]["method"] = "nonshared"
    assert tiny_server.generate(body).status_code == 200


def test_lr_cache_server_refuses_correcting_and_recomputing_methods_for_adapters(lr_servers):
    ours, _ = lr_servers
    for method in ("kvcmas", "cacheblend"):
        body = {
            "sampling_params": {"max_new_tokens": 2},
            "lora_path": AGENTS[0],
            "kvshare": {"workflow": "w-refuse", "agent": AGENTS[0], "method": method, "segments": turn_segments(1)},
        }
        r = ours.generate(body)
        assert r.status_code == 400 and "corrects or recomputes" in r.text, method
    assert ask(ours, "w-refuse", "prelr_shared", 1)["meta_info"]["kvshare"]["method"] == "prelr_shared"


def test_one_server_serves_prompt_agents_and_lora_agents_concurrently(lr_servers, tiny_model):
    """On an LR-cache server, base-model prompt-agent workflows use kvcmas, fullshared and a
    recomputing method while LoRA agents use PreLRShared, all at once. Each base-model request's
    cache is the plain model's (no LR term, no adapter delta): its nonshared answer is stock's
    without an adapter, its kvcmas gate opens on the anchors of earlier base-model workflows."""
    from transformers import AutoTokenizer

    from sglang_kvshare.testing.workflows import payload, segments, settle

    ours, stock = lr_servers
    tok = AutoTokenizer.from_pretrained(tiny_model)

    def prompt_workflow(wf, method, question, **extra):
        outputs, metas = {}, []
        for agent in ("solver", "critic", "final"):
            r = ours.generate(
                payload(wf, agent, method, segments(agent, outputs, question=question, slot="q-mixed"), 6, **extra)
            )
            assert r.status_code == 200, r.text
            out = r.json()
            metas.append(out["meta_info"]["kvshare"])
            outputs[agent] = out["text"] or "-"
        return metas

    def question(seed):
        return f"Question {seed}: " + " ".join(f"box {i} holds {(7 * i + seed) % 50} apples." for i in range(16))

    for seed in (1, 2):  # two base-model workflows: the kvcmas slot's pool gets two anchors per edge
        prompt_workflow(f"mixed-warm-{seed}", "kvcmas", question(seed), tau=1.0)
    settle(ours)
    jobs = {
        "kvcmas": lambda: prompt_workflow("mixed-kvcmas", "kvcmas", question(3), tau=1.0),
        "fullshared": lambda: prompt_workflow("mixed-full", "fullshared", question(4)),
        "cacheblend": lambda: prompt_workflow("mixed-blend", "cacheblend", question(5)),
        "prelr": lambda: [ask(ours, "mixed-lora", "prelr_shared", t)["meta_info"]["kvshare"] for t in range(4)],
        "base_nonshared": lambda: ask(ours, "mixed-base", "nonshared", 3, lora=False, max_new_tokens=10),
    }
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = {name: pool.submit(job) for name, job in jobs.items()}
        res = {name: f.result() for name, f in futures.items()}
    assert res["base_nonshared"]["output_ids"] == stock_generate(stock, stock_ids(tok, 3), None, 10)
    critic_q = res["kvcmas"][1]["segments"][1]
    assert critic_q["mode"] == "corrected" and critic_q["gate"] == "accepted", critic_q
    for meta in res["fullshared"][1:]:
        assert meta["injected_tokens"] > 0 and meta["computed_tokens"] < meta["prompt_tokens"]
    q = res["cacheblend"][1]["segments"][
        1
    ]  # the critic's question: recomputed from the solver's (2 layers: CacheBlend's check pass is all of them)
    assert q["mode"] == "recomputed" and q["source_agent"] == "solver" and q["recomputed_token_layers"] > 0, q
    for t, meta in enumerate(res["prelr"][1:], start=1):
        assert meta["method"] == "prelr_shared" and meta["computed_tokens"] < meta["prompt_tokens"], t
