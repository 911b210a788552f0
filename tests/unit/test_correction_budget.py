import torch

from sglang_kvshare.correction import SegmentKV, create_corrector


def _kv(seed, L=24):
    g = torch.Generator().manual_seed(seed)
    return SegmentKV(torch.randn(2, L, 16, generator=g), torch.randn(2, L, 16, generator=g))


def test_shrink_to_evicts_until_the_state_fits_and_keeps_the_rest_usable():
    c = create_corrector("kvcmas", rank_base=4, rank_delta=4)
    for i in range(6):
        c.observe("q" if i % 2 else "out:a", "a", "b", _kv(i), _kv(100 + i))
    full = c.nbytes()
    per_anchor = full // 6
    assert c.shrink_to(full - 1) == 1
    assert c.nbytes() <= full - per_anchor + 1
    evicted = c.shrink_to(full // 2)
    assert c.nbytes() <= full // 2 and evicted >= 2
    assert c.stats()["num_anchors"] == 6 - 1 - evicted
    remaining = c.stats()["num_anchors"]
    assert c.shrink_to(0) == remaining
    assert c.nbytes() == 0 and c.stats()["num_anchors"] == 0
