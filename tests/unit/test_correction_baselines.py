"""KVComm and GraphFlow baselines, and the method registry."""

import pytest
import torch

from sglang_kvshare.correction import SegmentKV, available_correctors, create_corrector

N_LAYERS, D = 3, 8


def _kv(L, seed):
    g = torch.Generator().manual_seed(seed)
    return SegmentKV(torch.randn(N_LAYERS, L, D, generator=g), torch.randn(N_LAYERS, L, D, generator=g))


def _add(kv, x):
    return SegmentKV(kv.k + x, kv.v + x)


def test_registry_defaults_and_overrides():
    assert available_correctors() == ["graphflow", "kvcmas", "kvcmas_nonchained", "kvcmas_plus", "kvcomm"]
    kvcomm = create_corrector("kvcomm")
    assert (kvcomm.config.num_anchors, kvcomm.config.tau, kvcomm.config.rank_base) == (20, 0.3, None)
    assert kvcomm.needs_reference and not kvcomm.chained
    kvcmas = create_corrector("kvcmas", tau=0.5)
    assert (kvcmas.config.num_anchors, kvcmas.config.rank_base, kvcmas.config.rank_delta) == (10, 32, 32)
    assert kvcmas.config.tau == 0.5 and kvcmas.chained and not kvcmas.needs_reference
    with pytest.raises(ValueError):
        create_corrector("nope")


def test_kvcomm_corrects_reference_and_never_layer_zero():
    c = create_corrector("kvcomm")
    ref, tgt = _kv(6, 0), _kv(6, 1)
    c.observe("q", "a0", "a1", _kv(6, 2), tgt, reference=ref)
    c.observe("q", "a0", "a1", _kv(6, 3), _kv(6, 4), reference=_add(ref, 30.0))
    r = c.correct("q", "a0", "a1", _kv(6, 5), reference=ref)
    assert r.accepted and r.entropy < 1e-3
    assert torch.equal(r.kv.k[0], ref.k[0]) and torch.equal(r.kv.v[0], ref.v[0])
    torch.testing.assert_close(r.kv.k[1:], tgt.k[1:], atol=1e-5, rtol=0)
    torch.testing.assert_close(r.kv.v[1:], tgt.v[1:], atol=1e-5, rtol=0)


def test_graphflow_rejects_until_observed_then_applies_without_matching():
    c = create_corrector("graphflow")
    ref1, tgt1 = _kv(6, 0), _kv(6, 1)
    r = c.correct("q", "a0", "a1", _kv(6, 9), reference=ref1)
    assert not r.accepted and r.reason == "no_relation"
    c.observe("q", "a0", "a1", _kv(6, 9), tgt1, reference=ref1)
    ref2, src2 = _kv(9, 2), _kv(9, 3)  # new content, longer: correct the covered prefix
    r = c.correct("q", "a0", "a1", src2, reference=ref2)
    assert r.accepted and r.entropy is None and r.corrected_len == 6
    torch.testing.assert_close(r.kv.k[:, :6], ref2.k[:, :6] + tgt1.k - ref1.k)
    torch.testing.assert_close(r.kv.v[:, :6], ref2.v[:, :6] + tgt1.v - ref1.v)
    # rows beyond the relation: the source agent's aligned cache, not the raw reference
    assert torch.equal(r.kv.k[:, 6:], src2.k[:, 6:]) and torch.equal(r.kv.v[:, 6:], src2.v[:, 6:])
    # constructed once: a later observation does not replace it
    c.observe("q", "a0", "a1", _kv(6, 4), _kv(6, 5), reference=_kv(6, 6))
    again = c.correct("q", "a0", "a1", _kv(9, 3), reference=ref2)
    assert torch.equal(again.kv.k, r.kv.k)
    # relations are per (slot, source, target)
    assert c.correct("q", "a2", "a1", ref2, reference=ref2).reason == "no_relation"
    assert c.correct("other", "a0", "a1", ref2, reference=ref2).reason == "no_relation"
    assert c.nbytes() == 2 * N_LAYERS * 6 * D * 4
    assert c.stats()["num_relations"] == 1


def test_graphflow_low_rank_storage():
    c = create_corrector("graphflow", rank=2)
    ref, tgt = _kv(6, 0), _kv(6, 1)
    c.observe("q", "a0", "a1", ref, tgt, reference=ref)
    assert c.nbytes() == 2 * N_LAYERS * (6 * 2 + 2 * D) * 4
    r = c.correct("q", "a0", "a1", ref, reference=ref)
    err = (r.kv.k - tgt.k).norm() / (tgt.k - ref.k).norm()
    assert 0.05 < err < 1.0
