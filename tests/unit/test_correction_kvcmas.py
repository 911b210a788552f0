"""KVCMAS: entropy gate, token-wise weights, chained correction, variable lengths."""

import math

import pytest
import torch

from sglang_kvshare.correction import SegmentKV, create_corrector
from sglang_kvshare.correction.gate import gate, normalized_entropy, token_weights

N_LAYERS, D = 2, 8


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _kv(L, seed, rank=None):
    """Random cache; ``rank`` makes each layer's K and V exactly low-rank."""
    g = _gen(seed)

    def mat():
        if rank is None:
            return torch.randn(N_LAYERS, L, D, generator=g)
        return torch.randn(N_LAYERS, L, rank, generator=g) @ torch.randn(N_LAYERS, rank, D, generator=g)

    return SegmentKV(mat(), mat())


def _add(kv, dk, dv=None):
    return SegmentKV(kv.k + dk, kv.v + (dk if dv is None else dv))


# ---- gate math --------------------------------------------------------------------------
def test_entropy_of_constructed_distributions():
    _, h = gate(torch.tensor([0.0, 40.0, 40.0]))
    assert h < 1e-12
    _, h = gate(torch.tensor([7.0, 7.0, 7.0, 7.0]))
    assert h == pytest.approx(1.0, abs=1e-12)
    g = torch.tensor([0.5, 0.25, 0.25])
    assert normalized_entropy(g) == pytest.approx(1.5 / math.log2(3))
    with pytest.raises(ValueError):
        normalized_entropy(torch.tensor([1.0]))


def test_token_weights_softmax_over_anchors():
    w = token_weights(torch.tensor([[0.5, 2.0], [1.5, 2.0]]))
    torch.testing.assert_close(w[:, 0], torch.tensor([math.e / (math.e + 1), 1 / (math.e + 1)]))
    torch.testing.assert_close(w[:, 1], torch.tensor([0.5, 0.5]))


# ---- gate decisions ---------------------------------------------------------------------
def test_fewer_than_two_compatible_anchors_reject():
    c = create_corrector("kvcmas")
    src = _kv(6, 0)
    r = c.correct("q", "a0", "a1", src)
    assert not r.accepted and r.reason == "few_anchors" and r.kv is None
    c.observe("q", "a0", "a1", src, _kv(6, 1))
    assert c.correct("q", "a0", "a1", src).reason == "few_anchors"
    c.observe("q", "a0", "a2", _kv(6, 2), _kv(6, 3))  # a delta for another consumer only
    r = c.correct("q", "a0", "a1", src)
    assert r.reason == "few_anchors" and r.num_anchors == 1
    assert c.stats()["rejected_few_anchors"] == 3


def test_single_anchor_pool_bypasses_gate():
    c = create_corrector("kvcmas", num_anchors=1)
    src, tgt = _kv(6, 0, rank=2), _kv(6, 1, rank=2)
    c.observe("q", "a0", "a1", src, tgt)
    r = c.correct("q", "a0", "a1", src)
    assert r.accepted and r.entropy is None and r.num_anchors == 1
    torch.testing.assert_close(r.kv.k, tgt.k, atol=1e-4, rtol=0)


def test_distinctive_anchor_gives_low_entropy_and_threshold_applies():
    c = create_corrector("kvcmas")
    src = _kv(6, 0)
    c.observe("q", "a0", "a1", src, _kv(6, 1))
    c.observe("q", "a0", "a1", _kv(6, 2), _kv(6, 3))
    r = c.correct("q", "a0", "a1", src)
    assert r.accepted and r.entropy < 1e-3 and r.num_anchors == 2
    strict = create_corrector("kvcmas", tau=-1.0)
    strict.observe("q", "a0", "a1", src, _kv(6, 1))
    strict.observe("q", "a0", "a1", _kv(6, 2), _kv(6, 3))
    r = strict.correct("q", "a0", "a1", src)
    assert not r.accepted and r.reason == "entropy" and r.entropy < 1e-3


def test_equidistant_anchors_give_entropy_one():
    src = _kv(5, 0)
    e = torch.randn(N_LAYERS, 5, D, generator=_gen(9))
    for tau, accepted in ((0.99, False), (1.0, True)):
        c = create_corrector("kvcmas", tau=tau)
        c.observe("q", "a0", "a1", _add(src, e), _kv(5, 1))
        c.observe("q", "a0", "a1", _add(src, -e), _kv(5, 2))
        r = c.correct("q", "a0", "a1", src)
        assert r.entropy == pytest.approx(1.0, abs=1e-6)
        assert r.accepted is accepted


def test_gate_uses_values_only():
    """Anchors whose values match the source are preferred whatever their keys are."""
    c = create_corrector("kvcmas")
    src = _kv(6, 0)
    far = torch.full((N_LAYERS, 6, D), 30.0)
    c.observe("q", "a0", "a1", SegmentKV(src.k + far, src.v), _kv(6, 1))
    c.observe("q", "a0", "a1", SegmentKV(src.k, src.v + 0.5), _kv(6, 2))
    members = c.pool("q").anchors
    d = c.gate_distances(src, members, 6)
    assert d[0].item() < 1e-4
    assert d[1].item() == pytest.approx(0.5 * math.sqrt(N_LAYERS * 6 * D), rel=1e-4)


# ---- weights ----------------------------------------------------------------------------
def test_token_weights_separate_for_keys_and_values():
    """Anchor A is 0.5 away in values and 1.5 in keys, anchor B the opposite; only A carries a
    unit delta, so values get w_A = e/(e+1) of it and keys 1/(e+1)."""
    c = create_corrector("kvcmas", tau=1.0)
    src = _kv(4, 0)
    ones = torch.ones(N_LAYERS, 4, D)
    base_a = SegmentKV(src.k + 1.5, src.v + 0.5)
    base_b = SegmentKV(src.k + 0.5, src.v + 1.5)
    c.observe("q", "a0", "a1", base_a, _add(base_a, ones))
    c.observe("q", "a0", "a1", base_b, base_b)
    r = c.correct("q", "a0", "a1", src)
    assert r.accepted
    e = math.e
    torch.testing.assert_close(r.kv.v, src.v + e / (e + 1), atol=1e-4, rtol=0)
    torch.testing.assert_close(r.kv.k, src.k + 1 / (e + 1), atol=1e-4, rtol=0)


def test_token_wise_selection_between_anchors():
    """Tokens 0-2 match anchor A, tokens 3-5 anchor B: each token takes its anchor's delta."""
    c = create_corrector("kvcmas", tau=1.0)
    src = _kv(6, 0)
    off = torch.zeros(N_LAYERS, 6, D)
    off[:, 3:] = 40.0
    da, db = torch.full_like(off, 2.0), torch.full_like(off, -3.0)
    base_a, base_b = _add(src, off), _add(src, 40.0 - off)
    c.observe("q", "a0", "a1", base_a, _add(base_a, da))
    c.observe("q", "a0", "a1", base_b, _add(base_b, db))
    r = c.correct("q", "a0", "a1", src)
    expect = src.k.clone()
    expect[:, :3] += 2.0
    expect[:, 3:] -= 3.0
    torch.testing.assert_close(r.kv.k, expect, atol=1e-4, rtol=0)


# ---- chaining and references ------------------------------------------------------------
def test_chained_correction_with_exact_low_rank_delta_recovers_target():
    c = create_corrector("kvcmas", rank_base=4, rank_delta=4)
    L = 40
    src = _kv(L, 0, rank=3)  # exactly representable at rank 4
    tgt = _add(src, _kv(L, 1, rank=2).k, _kv(L, 2, rank=2).v)
    other = _kv(L, 3, rank=3)
    c.observe("q", "a0", "a1", src, tgt)
    c.observe("q", "a0", "a1", _add(other, 50.0), _add(other, 51.0))
    r = c.correct("q", "a0", "a1", src)
    assert r.accepted and r.corrected_len == L
    torch.testing.assert_close(r.kv.k, tgt.k, atol=1e-3, rtol=0)
    torch.testing.assert_close(r.kv.v, tgt.v, atol=1e-3, rtol=0)
    assert all(a.use_count == 1 for a in c.pool("q").anchors)
    assert r.kv.k.data_ptr() != src.k.data_ptr()


def test_truncated_delta_is_approximate():
    """The stored rank bounds the correction: a rank-2 delta stored at rank 1 cannot be exact."""
    c = create_corrector("kvcmas", rank_base=4, rank_delta=1)
    src = _kv(40, 0, rank=3)
    tgt = _add(src, _kv(40, 1, rank=2).k)
    c.observe("q", "a0", "a1", src, tgt)
    c.observe("q", "a0", "a1", _add(src, 50.0), _add(src, 50.0))
    r = c.correct("q", "a0", "a1", src)
    err = (r.kv.k - tgt.k).norm() / (tgt.k - src.k).norm()
    assert 0.01 < err < 1.0


def test_non_chained_corrects_the_reference_not_the_source():
    c = create_corrector("kvcmas_nonchained")
    assert c.needs_reference and not c.chained
    ref, tgt = _kv(6, 0, rank=2), _kv(6, 1, rank=2)
    c.observe("q", "a0", "a1", _kv(6, 5), tgt, reference=ref)
    c.observe("q", "a0", "a1", _kv(6, 6), _kv(6, 7), reference=_add(ref, 50.0))
    r = c.correct("q", "a0", "a1", _kv(6, 8), reference=ref)  # the source plays no role
    assert r.accepted
    torch.testing.assert_close(r.kv.v, tgt.v, atol=1e-4, rtol=0)
    with pytest.raises(ValueError):
        c.correct("q", "a0", "a1", ref)


# ---- variable lengths -------------------------------------------------------------------
def test_variable_lengths_correct_covered_prefix_only():
    c = create_corrector("kvcmas")
    src = _kv(12, 0)
    delta = _kv(12, 1)
    c.observe(
        "q",
        "a0",
        "a1",
        SegmentKV(src.k[:, :10], src.v[:, :10]),
        SegmentKV(src.k[:, :10] + delta.k[:, :10], src.v[:, :10] + delta.v[:, :10]),
    )
    far = _add(SegmentKV(src.k[:, :8], src.v[:, :8]), 50.0)
    c.observe("q", "a0", "a1", far, _add(far, 1.0))
    c.observe("q", "a0", "a1", _kv(5, 3), _kv(5, 4))  # too short for the comparison prefix
    r = c.correct("q", "a0", "a1", src)
    assert r.accepted and r.corrected_len == 8 and r.num_anchors == 2
    torch.testing.assert_close(r.kv.k[:, :8], src.k[:, :8] + delta.k[:, :8], atol=1e-4, rtol=0)
    torch.testing.assert_close(r.kv.v[:, :8], src.v[:, :8] + delta.v[:, :8], atol=1e-4, rtol=0)
    assert torch.equal(r.kv.k[:, 8:], src.k[:, 8:]) and torch.equal(r.kv.v[:, 8:], src.v[:, 8:])
    short = c.correct("q", "a0", "a1", SegmentKV(src.k[:, :4], src.v[:, :4]))
    assert short.accepted and short.corrected_len == 4 and short.num_anchors == 3


# ---- partial fallback: a rejected segment gated again per block of rows ------------------
def _two_block_pool():
    """Rows 0-3: the first anchor matches the source exactly, the second is a little off (a
    clear match: block entropy 0); rows 4-7: the two anchors are equidistant (ambiguous: entropy
    1). Over the whole segment the two anchors are close, so its entropy is in between."""
    c = create_corrector("kvcmas")
    src = _kv(8, 0)
    e = torch.randn(N_LAYERS, 4, D, generator=_gen(9))
    near = torch.cat([torch.zeros(N_LAYERS, 4, D), e], 1)
    off = torch.cat([torch.full((N_LAYERS, 4, D), 0.3), -e], 1)
    c.observe("q", "a0", "a1", SegmentKV(src.k, src.v + near), _kv(8, 1))
    c.observe("q", "a0", "a1", SegmentKV(src.k, src.v + off), _kv(8, 2))
    return c, src


def test_a_rejected_segment_keeps_its_clear_blocks():
    c, src = _two_block_pool()
    whole = c.correct("q", "a0", "a1", src, tau=1.0)
    assert whole.accepted and 0.05 < whole.entropy < 0.95 and whole.blocks == ()
    tau = whole.entropy / 2
    assert c.correct("q", "a0", "a1", src, tau=tau).reason == "entropy"  # the paper's gate
    r = c.correct("q", "a0", "a1", src, tau=tau, block_size=4)
    assert r.accepted and r.rejected_rows == ((4, 8),) and r.entropy == pytest.approx(whole.entropy)
    assert [(b.lo, b.hi, b.accepted) for b in r.blocks] == [(0, 4, True), (4, 8, False)]
    assert r.blocks[0].entropy < 1e-3 and r.blocks[1].entropy == pytest.approx(1.0, abs=1e-6)
    # the correction itself does not depend on the gate
    torch.testing.assert_close(r.kv.k, whole.kv.k, atol=0, rtol=0)
    torch.testing.assert_close(r.kv.v, whole.kv.v, atol=0, rtol=0)
    assert c.stats()["num_partial"] == 1
    # an accepted segment accepts every block; a last block may be shorter
    ok = c.correct("q", "a0", "a1", src, tau=1.0, block_size=3)
    assert ok.rejected_rows == () and all(b.accepted for b in ok.blocks)
    assert [(b.lo, b.hi) for b in ok.blocks] == [(0, 3), (3, 6), (6, 8)]


def test_a_segment_whose_blocks_are_all_rejected_is_rejected():
    c, src = _two_block_pool()
    r = c.correct("q", "a0", "a1", src, tau=-1.0, block_size=4)
    assert not r.accepted and r.reason == "entropy" and r.kv is None
    assert len(r.blocks) == 2 and not any(b.accepted for b in r.blocks) and r.rejected_rows == ()
    with pytest.raises(ValueError, match="block_size"):
        c.correct("q", "a0", "a1", src, block_size=0)
    r = create_corrector("kvcmas").correct("q", "a0", "a1", src, block_size=4)
    assert r.reason == "few_anchors" and r.blocks == ()
