"""A corrected copy's KV slots: one contiguous run of the allocator's free slots (SGLang's own
token allocator, kept sorted once a request shares)."""

from types import SimpleNamespace

import torch
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

from sglang_kvshare.integration.cache.kv_io import contiguous_slots, keep_free_slots_sorted


def test_a_copy_takes_the_first_contiguous_run_of_free_slots():
    alloc = TokenToKVPoolAllocator(64, torch.float32, "cpu", None, False)
    every = alloc.alloc(64)  # slots 1..64
    for lo, hi in ((0, 8), (40, 56), (20, 30)):  # freed in the order evictions might leave them
        alloc.free(every[lo:hi])
    tree = SimpleNamespace(token_to_kv_pool_allocator=alloc, supports_prefix_sharing=lambda: False)
    assert contiguous_slots(tree, 12) is None  # SGLang's allocator as it is: not sorted
    stock = alloc.free_pages[:12]
    assert bool((stock[1:] - stock[:-1] != 1).any())  # its first 12: two runs

    keep_free_slots_sorted(alloc)
    assert alloc.need_sort and torch.equal(alloc.free_pages, alloc.free_pages.sort().values)
    run = contiguous_slots(tree, 12)
    assert torch.equal(run, torch.arange(41, 53))  # the first run of 12: slots 41..56, not 1..8
    assert len(alloc.free_pages) == 34 - 12 and not bool(torch.isin(run, alloc.free_pages).any())
    assert contiguous_slots(tree, 20) is None  # no run that long: the caller allocates as SGLang does

    alloc.free(run)  # freed slots wait unsorted, then merge sorted
    assert torch.equal(contiguous_slots(tree, 16), torch.arange(41, 57))
