"""KV leaves (``integration/cache/leaves.py``): per (agent, slot) low-rank corrections beside
shared slots, inherited along a chain of readers and dropped with their slots."""

import torch

from sglang_kvshare.integration.cache.leaves import KVLeaves, leaf_factors, uniform_offset
from sglang_kvshare.lowrank import LowRank
from sglang_kvshare.rope import shift_keys
from sglang_kvshare.rope.align import RopeSpec, inv_freq_for

L, H, D = 2, 2, 8
ROPE = RopeSpec(inv_freq_for(D, 10000.0), D, True)


def _factors(n, rank, seed):
    g = torch.Generator().manual_seed(seed)
    return [LowRank(torch.randn(L, n, rank, generator=g), torch.randn(L, rank, H * D, generator=g)) for _ in range(2)]


def _dense(leaves, agent, slots, shift=0):
    """``agent``'s leaves on ``slots`` as dense (k, v) [L, n, H*D] (``KVLeaves.add_to`` on zeros)."""
    k, v = torch.zeros(L, slots.numel(), H * D), torch.zeros(L, slots.numel(), H * D)
    leaves.add_to(agent, slots, k, v, key_shift=shift, rope=ROPE, head_dim=D)
    return k, v


def test_attach_inherit_and_drop_follow_the_slots():
    leaves = KVLeaves(64, "cpu")
    slots = torch.arange(10, 20)
    fk, fv = _factors(10, 3, 0)
    leaves.attach("critic", slots, fk, fv)
    assert leaves.has("critic", slots) and not leaves.has("final", slots)
    # the dense rows of a reader's slots, in the reader's order, with non-leaf slots zero
    row = torch.cat([torch.tensor([3, 4]), slots[5:], slots[:2]])
    dk, dv = _dense(leaves, "critic", row)
    torch.testing.assert_close(dk[:, 2:7], fk.reconstruct()[:, 5:])
    torch.testing.assert_close(dv[:, 7:], fv.reconstruct()[:, :2])
    assert dk[:, :2].abs().sum() == 0
    # a later reader of the critic's view inherits its leaf: same factors, no copy
    assert leaves.compatible("critic", "final", slots)
    leaves.inherit("critic", "final", slots[:6])
    assert leaves.stats()["leaves"] == 1 and leaves.leaves[0].live == 16
    torch.testing.assert_close(_dense(leaves, "final", slots[:6])[0], fk.reconstruct()[:, :6])
    # another correction of the same slots for the final agent collides
    gk, gv = _factors(4, 2, 1)
    leaves.attach("planner", slots[:4], gk, gv)
    assert not leaves.compatible("planner", "final", slots[:4])
    assert leaves.compatible("planner", "final", slots[6:])  # the final agent has no leaf there
    # freed slots lose every agent's entries; a leaf without rows is deleted
    leaves.drop(slots[:4])
    assert leaves.stats()["leaves"] == 1 and not leaves.has("final", slots[:4]) and leaves.has("final", slots[4:6])
    leaves.drop(slots)
    assert leaves.stats() == {"leaves": 0, "leaf_bytes": 0}


def test_two_leaves_on_one_request_stay_apart():
    """A request reading slots of two leaves gets both, each at its own rank: entries say which
    leaf and row correct each position."""
    leaves = KVLeaves(64, "cpu")
    a, b = torch.arange(0, 5), torch.arange(30, 38)
    fa, fb = _factors(5, 2, 2), _factors(8, 3, 3)
    leaves.attach("x", a, *fa)
    leaves.attach("x", b, *fb)
    row = torch.cat([b, torch.tensor([50, 51]), a])
    leaf = leaves.key_leaf("x", row)
    assert leaf.pos.tolist() == [*range(8), *range(10, 15)]
    assert [f.rank for f in leaf.k] == [2, 3] and leaf.which.tolist() == [1] * 8 + [0] * 5
    assert leaf.rows.tolist() == [*range(8), *range(5)]
    dk, dv = _dense(leaves, "x", row)
    torch.testing.assert_close(dk[:, :8], fb[0].reconstruct())
    torch.testing.assert_close(dv[:, 10:], fa[1].reconstruct())
    assert dk[:, 8:10].abs().sum() == 0


def test_leaf_factors_turn_the_keys_into_the_rows_rope_frame():
    """A leaf of a canonical correction (keys at 0..n-1) for rows cached at p0 + t: its keys are
    the correction turned by p0, at full rank exactly, and ``add_to`` turns them back."""
    n, p0 = 12, 37
    g = torch.Generator().manual_seed(4)
    dk, dv = torch.randn(L, n, H * D, generator=g), torch.randn(L, n, H * D, generator=g)
    fk, fv = leaf_factors(dk, dv, p0, H * D, ROPE, D, torch.float32)
    moved = torch.stack([shift_keys(dk[layer].view(n, H, D), p0, ROPE).reshape(n, H * D) for layer in range(L)])
    torch.testing.assert_close(fk.reconstruct(), moved, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(fv.reconstruct(), dv, atol=1e-4, rtol=1e-4)
    # added back to the canonical frame through B alone (how a later agent sums an inherited leaf)
    leaves = KVLeaves(64, "cpu")
    leaves.attach("x", torch.arange(n), fk, fv)
    back_k, back_v = _dense(leaves, "x", torch.arange(n), shift=-p0)
    torch.testing.assert_close(back_k, dk, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(back_v, dv, atol=1e-4, rtol=1e-4)
    low_k, _ = leaf_factors(dk, dv, p0, 2, ROPE, D, torch.float32)
    assert low_k.rank == 2 and (low_k.reconstruct() - moved).norm() > 0.1 * moved.norm()


def test_uniform_offset():
    assert uniform_offset(torch.full((5,), -1), 40) == 40  # the source's own positions
    assert uniform_offset(torch.arange(7, 12), 40) == 7  # a view: rows carry 7, 8, ...
    assert uniform_offset(torch.tensor([7, 8, -1, -1]), 40) is None  # mixed
