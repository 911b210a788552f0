"""Stored hidden states of densely prefilled shared segments (DroidSpeak's and RelayCaching's entry
points into later layers)."""

import torch

from sglang_kvshare.recompute.hidden_store import HiddenStore


def test_hidden_store_serves_only_fully_captured_matching_tokens():
    store = HiddenStore(max_bytes=3 * 4 * 5 * 4 + 8)  # this entry and two 4-byte ones
    entry = store.begin(("wf", "q"), num_layers=3, n=4, hidden=5, dtype=torch.float32, device="cpu")
    entry.token_ids[:] = torch.tensor([7, 8, 9, 10])
    entry.filled[:2] = True
    assert store.get(("wf", "q"), [7, 8]) is entry
    assert store.get(("wf", "q"), [7, 8, 9]) is None  # row 2 not captured yet
    assert store.get(("wf", "q"), [7, 9]) is None  # other tokens
    entry.filled[:] = True
    assert store.get(("wf", "q"), [7, 8, 9, 10]) is entry
    assert entry.nbytes == 3 * 4 * 5 * 4
    for i in range(2):
        store.begin(("wf", f"s{i}"), 1, 1, 1, torch.float32, "cpu")
    assert ("wf", "q") in store.items and store.nbytes() == 248
    store.begin(("wf", "s2"), 1, 1, 1, torch.float32, "cpu")
    assert ("wf", "q") not in store.items and len(store.items) == 3  # the oldest evicted
