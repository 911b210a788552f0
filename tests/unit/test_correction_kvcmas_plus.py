"""kvcmas_plus: energy-chosen ranks and the per-edge running mean delta."""

import torch

from sglang_kvshare.correction import SegmentKV, create_corrector

N_LAYERS, D = 2, 24


def _mat(L, rank, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N_LAYERS, L, rank, generator=g) @ torch.randn(N_LAYERS, rank, D, generator=g)


def _kv(L, rank, seed):
    return SegmentKV(_mat(L, rank, seed), _mat(L, rank, seed + 1000))


def test_energy_chooses_rank_below_cap():
    c = create_corrector("kvcmas_plus", energy=0.999, rank_delta=20, rank_base=3)
    src = _kv(30, 6, 0)
    c.observe("q", "a0", "a1", src, SegmentKV(src.k + _mat(30, 5, 1), src.v + _mat(30, 5, 2)))
    anchor = c.pool("q").anchors[0]
    dk, dv = anchor.deltas["a1"]
    assert dk.rank == 5 and dv.rank == 5  # exact rank found, below the cap of 20
    assert anchor.base_k.rank == 3  # the cap binds for the rank-6 base
    capped = create_corrector("kvcmas_plus", energy=0.999, rank_delta=2)
    capped.observe("q", "a0", "a1", src, SegmentKV(src.k + _mat(30, 5, 1), src.v))
    assert capped.pool("q").anchors[0].deltas["a1"][0].rank == 2


def test_edge_mean_is_running_mean_with_row_counts():
    c = create_corrector("kvcmas_plus", energy=None, rank_delta=None, rank_base=None)
    deltas = [torch.full((N_LAYERS, L, D), float(x)) for L, x in ((6, 1.0), (6, 3.0), (9, 8.0))]
    for i, d in enumerate(deltas):
        src = _kv(d.shape[1], 4, 10 + i)
        c.observe("q", "a0", "a1", src, SegmentKV(src.k + d, src.v - d))
    m = c.edge_mean("q", "a0", "a1")
    assert m.counts.tolist() == [3] * 6 + [1] * 3
    k = m.k.reconstruct()
    torch.testing.assert_close(k[:, :6], torch.full((N_LAYERS, 6, D), 4.0))
    torch.testing.assert_close(k[:, 6:], torch.full((N_LAYERS, 3, D), 8.0))
    torch.testing.assert_close(m.v.reconstruct()[:, :6], torch.full((N_LAYERS, 6, D), -4.0))
    assert c.edge_mean("q", "a0", "a2") is None
    assert c.nbytes() > sum(a.nbytes for a in c.pool("q").anchors)


def test_edge_mix_blends_anchor_estimate_with_edge_mean():
    src = _kv(6, 3, 0)
    far = _kv(6, 3, 1)
    results = {}
    for mix in (0.0, 0.5, 1.0):
        c = create_corrector("kvcmas_plus", edge_mix=mix)
        c.observe("q", "a0", "a1", src, SegmentKV(src.k + 1.0, src.v + 1.0))
        far50 = SegmentKV(far.k + 50.0, far.v + 50.0)
        c.observe("q", "a0", "a1", far50, SegmentKV(far50.k + 3.0, far50.v + 3.0))
        r = c.correct("q", "a0", "a1", src)
        assert r.accepted
        results[mix] = r.kv.k - src.k
    # anchor mix picks anchor 0 (delta 1), the edge mean is (1 + 3) / 2 = 2
    torch.testing.assert_close(results[0.0], torch.full_like(results[0.0], 1.0), atol=1e-3, rtol=0)
    torch.testing.assert_close(results[1.0], torch.full_like(results[1.0], 2.0), atol=1e-3, rtol=0)
    torch.testing.assert_close(results[0.5], torch.full_like(results[0.5], 1.5), atol=1e-3, rtol=0)
