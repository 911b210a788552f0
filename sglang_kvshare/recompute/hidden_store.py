"""Stored hidden states of densely prefilled shared segments (DroidSpeak's and RelayCaching's
entry points into later layers), byte-bounded, oldest forgotten first."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

import torch

HIDDEN_STORE_BYTES = 512 * 2**20  # stored hidden states of all workflows together


@dataclass
class StoredHidden:
    """Residual stream entering every layer for the tokens of one densely prefilled segment."""

    x: torch.Tensor  # [num_layers, n, hidden]
    token_ids: torch.Tensor  # [n] int64
    filled: torch.Tensor  # [n] bool: rows whose every layer has been captured

    def covers(self, token_ids: list[int]) -> bool:
        n = len(token_ids)
        return (
            n <= len(self.token_ids) and bool(self.filled[:n].all()) and self.token_ids[:n].tolist() == list(token_ids)
        )

    @property
    def nbytes(self) -> int:
        return self.x.numel() * self.x.element_size()


class HiddenStore:
    """(workflow, slot) -> the latest dense prefill's :class:`StoredHidden`; the oldest entries
    are evicted to stay within ``max_bytes`` (the newest is always kept)."""

    def __init__(self, max_bytes: int = HIDDEN_STORE_BYTES):
        self.max_bytes = max_bytes
        self.items: "OrderedDict[tuple[str, str], StoredHidden]" = OrderedDict()

    def begin(self, key, num_layers: int, n: int, hidden: int, dtype, device) -> StoredHidden:
        self.items.pop(key, None)
        entry = StoredHidden(
            x=torch.zeros(num_layers, n, hidden, dtype=dtype, device=device),
            token_ids=torch.full((n,), -1, dtype=torch.int64),
            filled=torch.zeros(n, dtype=torch.bool),
        )
        self.items[key] = entry
        while len(self.items) > 1 and self.nbytes() > self.max_bytes:
            self.items.popitem(last=False)
        return entry

    def get(self, key, token_ids: list[int]) -> Optional[StoredHidden]:
        entry = self.items.get(key)
        return entry if entry is not None and entry.covers(token_ids) else None

    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.items.values())
