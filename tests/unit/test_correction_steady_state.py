"""What long-running serving needs of the correctors: batched factor math, one byte budget over
all pools, the online tau, warm-start state, the split observe, the uncovered rows."""

import math
import os

import pytest
import torch

from sglang_kvshare.correction import SegmentKV, create_corrector, store
from sglang_kvshare.correction.gate import gate, relative_distances
from sglang_kvshare.correction.pool import evict_lfu_oldest
from sglang_kvshare.correction.tuning import TauController
from sglang_kvshare.lowrank import Dense, FactorBatch, truncated_svd

N_LAYERS, D = 3, 12


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _kv(L, seed):
    return SegmentKV(_randn(N_LAYERS, L, D, seed=seed), _randn(N_LAYERS, L, D, seed=seed + 1000))


# ---- lowrank: the Gram/eigh SVD and FactorBatch -----------------------------------------
def test_gram_factorisation_matches_the_svd_on_tall_matrices():
    Z = _randn(4, 60, 10, seed=1) @ _randn(4, 10, 10, seed=2)
    f = truncated_svd(Z, 5)
    U, S, Vh = torch.linalg.svd(Z, full_matrices=False)
    ref = (U[..., :5] * S[..., None, :5]) @ Vh[..., :5, :]
    torch.testing.assert_close(f.reconstruct(), ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(f.B @ f.B.transpose(-1, -2), torch.eye(5).expand(4, 5, 5), atol=1e-5, rtol=0)


def _members():
    """Low-rank members of two ranks (padding) and a dense one, all [N_LAYERS, 20, D]."""
    return [
        truncated_svd(_randn(N_LAYERS, 20, D, seed=3), 4),
        truncated_svd(_randn(N_LAYERS, 20, D, seed=4), 2),
        Dense(_randn(N_LAYERS, 20, D, seed=5)),
        truncated_svd(_randn(N_LAYERS, 25, D, seed=6), 3),
    ]


def test_factor_batch_equals_member_by_member_math():
    members, k, layers = _members(), 17, slice(1, 3)
    fb = FactorBatch(members, k)
    recs = torch.stack([m[layers].reconstruct(k) for m in members])  # [N, c, k, D]
    torch.testing.assert_close(fb.reconstruct(layers), recs, atol=1e-5, rtol=0)
    x = _randn(2, k, D, seed=7)
    torch.testing.assert_close(fb.sq_distances(x, layers), (x[None] - recs).square().sum(-1), atol=1e-3, rtol=1e-4)
    w = torch.softmax(_randn(len(members), 2, k, seed=8), 0)
    torch.testing.assert_close(fb.mix(w, layers), (w[..., None] * recs).sum(0), atol=1e-5, rtol=0)


def test_bfloat16_products_stay_within_bfloat16_rounding_of_the_float32_math():
    members, k, layers = _members(), 17, slice(1, 3)
    exact, fast = FactorBatch(members, k), FactorBatch(members, k, torch.bfloat16)
    x = _randn(2, k, D, seed=7)
    w = torch.softmax(_randn(len(members), 2, k, seed=8), 0)
    for what in (
        lambda fb: fb.sq_distances(x, layers),
        lambda fb: fb.mix(w, layers),
        lambda fb: fb.reconstruct(layers),
    ):
        a, b = what(exact), what(fast)
        assert b.dtype == torch.float32
        err = float((a - b).norm() / a.norm())
        assert 0 < err < 2e-2, err  # rounded inputs (2^-8), not the float32 result
    with pytest.raises(ValueError, match="compute_dtype"):
        FactorBatch(members, k, torch.float16)


def _corrected(**config):
    """The correction of one segment by a kvcmas corrector of ``config`` that observed three."""
    c = create_corrector("kvcmas", tau=1.0, rank_base=4, rank_delta=4, **config)
    for i in range(3):
        base = _kv(40, 20 + i)
        c.observe("q", "a", "b", base, SegmentKV(base.k + 0.1, base.v - 0.1))
    return c.correct("q", "a", "b", _kv(40, 10))


def test_bfloat16_products_change_the_correction_little():
    exact, fast = _corrected(compute_dtype=torch.float32), _corrected(compute_dtype=torch.bfloat16)
    assert exact.entropy == pytest.approx(fast.entropy, abs=1e-2)
    for which in ("k", "v"):
        a, b = getattr(exact.delta, which), getattr(fast.delta, which)
        assert 0 < float((a - b).norm() / a.norm()) < 1e-2


def test_half_precision_factors_change_the_correction_little():
    exact, half = _corrected(factor_dtype=torch.float32).kv, _corrected(factor_dtype=torch.float16).kv
    err = (exact.v - half.v).norm() / exact.v.norm()
    assert 0 < err < 1e-3


# ---- the gate's scale -------------------------------------------------------------------
def test_relative_distances_make_the_entropy_length_free():
    """The same relative separation gives the same entropy on any segment length, where eq. 9's
    raw distances (which grow with sqrt(rows)) drive it to 0 on long segments."""
    for rows in (10, 1000):
        d = torch.tensor([1.0, 1.02, 1.05]) * math.sqrt(rows)
        _, h_rel = gate(relative_distances(d), 0.02)
        assert h_rel == pytest.approx(gate(torch.tensor([1.0, 1.02, 1.05]), 0.02)[1], rel=1e-6)
    assert gate(torch.tensor([1.0, 1.02, 1.05]) * math.sqrt(1000) * 100)[1] < 1e-6  # raw, long: one-hot
    assert relative_distances(torch.tensor([0.0, 2.0]))[1] > 1e9  # an exact match dominates


# ---- one byte budget over all pools -------------------------------------------------------
def test_budget_eviction_is_lfu_among_the_oldest_of_all_pools_and_keeps_the_new_anchor():
    c = create_corrector("kvcmas", rank_base=2, rank_delta=2)
    c.observe("out:a", "a", "b", _kv(8, 1), _kv(8, 2))  # short, old, used
    c.observe("q", "a", "b", _kv(60, 3), _kv(60, 4))  # long, older than the next two
    c.observe("out:a", "a", "b", _kv(8, 5), _kv(8, 6))
    c.pool("out:a").anchors[0].use_count = 3
    new = c.record(c.prepare("q", "a", "b", _kv(60, 7), _kv(60, 8)))
    total = c.nbytes()
    evicted = evict_lfu_oldest([c], total - 1, keep=[new])
    # the least used of the oldest: the old long anchor (0 uses), not the used short one
    assert evicted == 1 and len(c.pool("q")) == 1 and c.pool("q").anchors[0] is new
    assert len(c.pool("out:a")) == 2
    assert evict_lfu_oldest([c], 0, keep=[new]) == 2 and c.stats()["num_anchors"] == 1


def test_prepare_then_record_is_observe_and_prepare_is_pure():
    a = create_corrector("kvcmas", rank_base=3, rank_delta=3)
    b = create_corrector("kvcmas", rank_base=3, rank_delta=3)
    src, tgt = _kv(30, 1), _kv(30, 2)
    before = (src.k.clone(), tgt.v.clone())
    a.observe("q", "x", "y", src, tgt)
    prepared = b.prepare("q", "x", "y", src, tgt)
    assert b.stats()["num_anchors"] == 0  # nothing recorded yet
    b.record(prepared)
    assert torch.equal(src.k, before[0]) and torch.equal(tgt.v, before[1])
    a.observe("q", "x", "y", _kv(30, 3), _kv(30, 4))
    b.observe("q", "x", "y", _kv(30, 3), _kv(30, 4))
    probe = _kv(30, 5)
    ra, rb = a.correct("q", "x", "y", probe, tau=1.0), b.correct("q", "x", "y", probe, tau=1.0)
    assert ra.accepted and torch.equal(ra.kv.k, rb.kv.k)
    assert ra.anchor_bytes_per_token == pytest.approx(a.nbytes() / 2 / 30)


# ---- rows no anchor covers ------------------------------------------------------------------
@pytest.mark.parametrize("name", ["kvcmas_nonchained", "graphflow"])
def test_non_chained_methods_keep_the_source_beyond_the_covered_rows(name):
    c = create_corrector(name) if name == "graphflow" else create_corrector(name, tau=1.0)
    for i in range(2):
        c.observe("q", "a", "b", _kv(6, 30 + i), _kv(6, 40 + i), reference=_kv(6, 50 + i))
    src, ref = _kv(10, 1), _kv(10, 2)
    r = c.correct("q", "a", "b", src, reference=ref)
    assert r.accepted and r.corrected_len == 6
    assert torch.equal(r.kv.k[:, 6:], src.k[:, 6:]) and torch.equal(r.kv.v[:, 6:], src.v[:, 6:])
    torch.testing.assert_close(r.kv.v[:, :6], ref.v[:, :6] + r.delta.v)


def test_kvcomm_corrects_only_segments_two_anchors_cover_entirely():
    c = create_corrector("kvcomm", tau=1.0)
    for i in range(2):
        c.observe("q", "a", "b", _kv(6, 30 + i), _kv(6, 40 + i), reference=_kv(6, 50 + i))
    assert c.correct("q", "a", "b", _kv(10, 1), reference=_kv(10, 2)).reason == "coverage"
    assert c.correct("q", "a", "b", _kv(5, 1), reference=_kv(5, 2)).accepted


# ---- the online tau --------------------------------------------------------------------------
def test_tau_controller_holds_the_token_weighted_reuse_target():
    c = TauController(0.3, target_rho=0.75)
    assert c.tau() == 1.0  # no gate seen yet: accept
    c.observe_gate(0.9, 100)
    assert c.tau() == 0.9
    for h, n in [(0.5, 100), (0.7, 100), (0.95, 100)]:
        c.observe_gate(h, n)
    assert c.tau() == 0.9  # 0.5, 0.7, 0.9 cover 75 % of the tokens
    c.observe_gate(0.1, 400)  # a long segment weighs more
    assert c.tau() == 0.7
    with pytest.raises(ValueError):
        TauController(0.3, target_rho=0.0)


def test_tau_controller_counts_head_rows_as_not_reused():
    plain, headed = TauController(0.3, target_rho=0.5), TauController(0.3, target_rho=0.5)
    for h in (0.1, 0.2, 0.3, 0.4):
        plain.observe_gate(h, 100)
        headed.observe_gate(h, 100, recomputed=20)
    assert plain.tau() == 0.2  # two segments of four: half the tokens
    assert headed.tau() == 0.3  # 80 reused rows each: three segments for 50 % of 400
    headed.observe_gate(0.5, 100, recomputed=100)  # a segment recomputed whole reuses nothing
    assert headed.tau() == 0.4  # 250 of 500 tokens: 0.1-0.4 reuse 320
    greedy = TauController(0.3, target_rho=0.95)
    greedy.observe_gate(0.2, 100, recomputed=10)
    assert greedy.tau() == 1.0  # even accepting everything reuses 0.9: accept everything


def test_tau_controller_error_guard_caps_and_recovers():
    c = TauController(0.8, max_error=0.05)
    c.observe_error(0.6, 0.2)  # a correction accepted at entropy 0.6 erred
    assert c.tau() == pytest.approx(0.54) and c.num_violations == 1
    c.observe_error(0.3, 0.01)
    assert 0.54 < c.tau() < 0.8
    assert TauController(0.3).tau() == 0.3  # no target: the fixed tau
    unguarded = TauController(0.8)
    unguarded.observe_error(0.6, 0.9)
    assert unguarded.tau() == 0.8 and unguarded.last_error == 0.9


# ---- warm start -------------------------------------------------------------------------------
def test_pool_file_round_trip_and_refusals(tmp_path):
    c = create_corrector("kvcmas", rank_base=2, rank_delta=2, factor_dtype=torch.float16)
    g = create_corrector("graphflow")
    for i in range(3):
        c.observe("q", "a", "b", _kv(30, i), _kv(30, 10 + i))
        g.observe("q", "a", "b", _kv(30, i), _kv(30, 10 + i), reference=_kv(30, 20 + i))
    c.pool("q").anchors[0].use_count = 4
    path = str(tmp_path / "pool.pt")
    store.save(path, {"model": "m", "rank": 2}, {"kvcmas": c, "graphflow": g})
    made = {}
    n = store.load(
        path,
        {"model": "m", "rank": 2},
        made,
        create=lambda name: made.setdefault(
            name,
            create_corrector(name, rank_base=2, rank_delta=2, factor_dtype=torch.float16)
            if name == "kvcmas"
            else create_corrector(name),
        ),
    )
    assert n == 4 and made["kvcmas"].nbytes() == c.nbytes() and made["graphflow"].nbytes() == g.nbytes()
    assert [a.use_count for a in made["kvcmas"].pool("q").anchors] == [4, 0, 0]
    probe = _kv(30, 99)
    assert torch.equal(
        c.correct("q", "a", "b", probe, tau=1.0).kv.v, made["kvcmas"].correct("q", "a", "b", probe, tau=1.0).kv.v
    )
    with pytest.raises(store.AnchorPoolFileError, match="rank: file 2, server 3"):
        store.load(path, {"model": "m", "rank": 3}, {})
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a pool")
    with pytest.raises(store.AnchorPoolFileError, match="not a readable anchor pool file"):
        store.read(str(bad))
    torch.save({"format": "something else"}, tmp_path / "other.pt")
    with pytest.raises(store.AnchorPoolFileError, match="not an anchor pool file"):
        store.read(str(tmp_path / "other.pt"))
    assert not any(p.name.startswith(".pool.pt.tmp") for p in tmp_path.iterdir())
    assert os.path.getsize(bad) == len(b"not a pool")


def test_the_server_flag_chooses_the_products_dtype():
    from sglang_kvshare.config import KVShareArgs
    from sglang_kvshare.integration.state.session import Session
    from sglang_kvshare.lowrank import native_bfloat16

    auto = torch.bfloat16 if native_bfloat16("cpu") else torch.float32
    for flag, want in (("auto", auto), ("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        session = Session(KVShareArgs(anchor_compute_dtype=flag))
        assert session.corrector("kvcmas").config.compute_dtype == want
        assert session.stats()["correctors"]["kvcmas"]["compute_dtype"] == str(want).removeprefix("torch.")
