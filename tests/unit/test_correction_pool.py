"""Anchor pool: insertion, lookup, LFU-among-5-oldest eviction, byte accounting."""

import torch

from sglang_kvshare.correction import AnchorPool, SegmentKV, create_corrector
from sglang_kvshare.correction.pool import Anchor
from sglang_kvshare.lowrank import Dense

N_LAYERS, D = 2, 8


def _kv(L, seed):
    g = torch.Generator().manual_seed(seed)
    return SegmentKV(torch.randn(N_LAYERS, L, D, generator=g), torch.randn(N_LAYERS, L, D, generator=g))


def _anchor(i):
    z = Dense(torch.zeros(1, 2, 2))
    return Anchor(base_k=z, base_v=z, deltas={}, source_agent=None, key=(i,))


def test_eviction_is_lfu_among_five_oldest_with_oldest_tiebreak():
    pool = AnchorPool(capacity=7, num_oldest=5)
    anchors = [_anchor(i) for i in range(7)]
    for a, uses in zip(anchors, [3, 1, 4, 1, 0, 0, 2]):
        assert pool.insert(a) == []
        a.use_count = uses
    assert [a.serial for a in pool.anchors] == list(range(7))
    # oldest five: uses 3,1,4,1,0 -> serial 4 (serial 5 also has 0 uses but is not among them)
    assert pool.insert(_anchor(7)) == [anchors[4]]
    # oldest five now serials 0,1,2,3,5 -> serial 5 (0 uses)
    assert pool.insert(_anchor(8)) == [anchors[5]]
    # oldest five now 0,1,2,3,6 with uses 3,1,4,1,2 -> tie at 1, the older (serial 1) goes
    assert pool.insert(_anchor(9)) == [anchors[1]]
    assert len(pool) == 7
    assert [a.key[0] for a in pool.anchors] == [0, 2, 3, 6, 7, 8, 9]


def test_byte_budget_evicts_but_keeps_the_new_anchor():
    big = Anchor(Dense(torch.zeros(1, 10, 10)), Dense(torch.zeros(1, 10, 10)), {}, None, ("big",))
    pool = AnchorPool(capacity=10, max_bytes=850)
    for i in range(3):
        pool.insert(_anchor(i))  # 32 bytes each
    pool.anchors[0].use_count = 5
    evicted = pool.insert(big)  # 800 bytes: must evict two
    assert [a.key for a in evicted] == [(1,), (2,)]
    assert big in pool.anchors and pool.nbytes == 832


def test_observe_inserts_merges_fan_out_and_counts_bytes():
    c = create_corrector("kvcmas", rank_base=3, rank_delta=2)
    src, t1, t2 = _kv(10, 0), _kv(10, 1), _kv(10, 2)
    c.observe("q", "a0", "a1", src, t1)
    c.observe("q", "a0", "a2", src, t2)  # same source instance, second consumer
    pool = c.pool("q")
    assert len(pool) == 1 and set(pool.anchors[0].deltas) == {"a1", "a2"}
    per_factor = lambda r: 4 * N_LAYERS * (10 * r + r * D)  # noqa: E731
    expected = 2 * per_factor(3) + 4 * per_factor(2)
    assert pool.anchors[0].nbytes == expected and c.nbytes() == expected
    c.observe("q", "a0", "a1", _kv(10, 3), t1)  # new content -> new anchor
    c.observe("other", "a0", "a1", src, t1)  # pools are per slot
    assert len(c.pool("q")) == 2 and len(c.pool("other")) == 1
    s = c.stats()
    assert (s["num_inserted"], s["num_merged"], s["num_anchors"]) == (3, 1, 3)
    assert s["nbytes"] == c.nbytes() == expected + 2 * (2 * per_factor(3) + 2 * per_factor(2))


def test_pool_capacity_evicts_through_corrector():
    c = create_corrector("kvcmas", num_anchors=2)
    for seed in range(4):
        c.observe("q", "a0", "a1", _kv(4, 10 + seed), _kv(4, 20 + seed))
    assert len(c.pool("q")) == 2 and c.stats()["num_evicted"] == 2


def test_kvcomm_stores_full_dimensional_anchors():
    c = create_corrector("kvcomm")
    ref, tgt = _kv(6, 0), _kv(6, 1)
    c.observe("q", "a0", "a1", _kv(6, 2), tgt, reference=ref)
    assert c.nbytes() == 4 * (4 * N_LAYERS * 6 * D)  # base K, V + delta K, V, float32
