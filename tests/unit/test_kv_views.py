"""KVViews: reference counts of shared KV slots and the RoPE offsets a reader attends them with."""

from __future__ import annotations

import torch

from sglang_kvshare.integration.cache.views import KVViews
from sglang_kvshare.rope import RopeSpec, shift_keys


def _views():
    return KVViews(32, "cpu")


def test_a_shared_slot_is_freed_by_its_last_holder_only():
    v = _views()
    src = torch.tensor([4, 5, 6, 7])
    v.share(src, torch.arange(10, 14))
    v.share(src[:2], torch.arange(10, 12))  # a second reader of the first two slots
    assert v.extra_total == 6 and v.marked == 4
    assert v.release(src).tolist() == []  # the source goes first: readers keep every slot
    assert v.release(src[:2]).tolist() == []
    assert sorted(v.release(src).tolist()) == [4, 5, 6, 7]  # the last holder frees
    assert v.extra_total == 0 and v.marked == 0 and v.double_frees == 0
    assert bool((v.rope_pos == -1).all())


def test_holders_freed_in_one_call_count_per_occurrence():
    v = _views()
    v.share(torch.tensor([2, 3]), torch.tensor([0, 1]))
    freed = v.release(torch.tensor([9, 2, 3, 2, 3]))  # a free group with both holders, and slot 9
    assert sorted(freed.tolist()) == [2, 3, 9]
    assert v.double_frees == 0
    v.share(torch.tensor([5]), torch.tensor([0]))
    v.release(torch.tensor([5, 5, 5]))  # held by two, freed three times
    assert v.double_frees == 1


def test_unshared_frees_pass_through_unchanged():
    v = _views()
    idx = torch.tensor([8, 3, 5])
    assert v.release(idx) is idx


def test_offsets_are_read_position_minus_rope_position():
    v = _views()
    v.share(torch.tensor([4, 5, 6]), torch.tensor([3, 4, 5]))
    row = torch.tensor([1, 2, 4, 5, 6, 9])  # own slots, the view at positions 2..4, own slot
    assert v.offsets(row).tolist() == [0, 0, -1, -1, -1, 0]
    assert v.offsets(torch.tensor([1, 2, 9])) is None
    # a chain: a later view of the same slots keeps the positions the keys were rotated for
    v.share(torch.tensor([4, 5, 6]), torch.tensor([40, 41, 42]))
    assert v.offsets(torch.tensor([4, 5, 6]), start=10).tolist() == [7, 7, 7]


def test_align_keys_rotates_view_rows_to_their_read_positions():
    rope = RopeSpec(inv_freq=1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8)), rotary_dim=8)
    keys = torch.randn(4, 3, 2, 8)  # [n, L, H, D]
    slots = torch.tensor([1, 2, 3, 4])
    v = _views()
    v.share(torch.tensor([3, 4]), torch.tensor([20, 21]))  # rotated for 20, 21; read at 12, 13
    out = v.align_keys(keys, slots, 10, rope, dim=1)
    torch.testing.assert_close(out[:2], keys[:2])
    want = shift_keys(keys[2:].reshape(2, 6, 8), -8, rope).reshape(2, 3, 2, 8)
    torch.testing.assert_close(out[2:], want)
    assert (out[2:] - keys[2:]).abs().max() > 1e-3
    # the same rows with layers first
    torch.testing.assert_close(v.align_keys(keys.transpose(0, 1), slots, 10, rope, dim=0), out.transpose(0, 1))
