"""ReBaseShared: the current agent's OWN LR column, kept from its adapted hidden states.

ReBaseShared builds the shared context's base cache (``X_neut W_0``) and every OTHER agent's LR
column (``s_k X_neut A_k^T``) from adapter-free hidden states, but agent ``j``'s own column from
the adapted states of its turn, ``s_j X_{j,adpt} A_j^T`` (``tests/lr_cache_sim.rebase_shared``).
In the engine the adapter-free pass writes every column, column ``j`` included; the adapted
pass's column ``j`` is then put over it, row by row at the same token positions:

- DB: the adapted request and its adapter-free twin run in the same batches; after a forward,
  column ``j`` of the positions both computed is copied from the adapted rows to the twin's
  (``own_span`` gives those positions).
- LP: the adapted turn's KV is freed before the rebuild runs, so column ``j`` of its computed rows
  is taken first (``OwnLRColumn.take``) and put onto the rebuild's rows once they are written
  (``OwnLRColumn.put``).

LR buffers are ``[kv slots, columns, r_max]`` (one per layer, and per kind: value, key); slots are
int64 KV slot indices. Plain torch, no SGLang.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch


def own_span(*spans: tuple[int, int], since: int = 0) -> Optional[tuple[int, int]]:
    """Token positions ``[lo, hi)`` that every ``[start, end)`` of ``spans`` covers, from
    ``since`` on; None when empty. ``spans`` are the positions each request computed itself
    (its KV rows past its cached prefix), ``since`` the first position a forward wrote."""
    lo = max([since, *(s for s, _ in spans)])
    hi = min(e for _, e in spans)
    return (lo, hi) if lo < hi else None


@dataclass(frozen=True)
class OwnLRColumn:
    """Column ``column`` of every LR buffer at the token positions ``[start, start + n)`` of an
    adapted turn: ``values[b]`` is ``[n, r_max]`` (a copy, buffer ``b``'s dtype and device) and
    ``token_ids`` the n tokens at those positions (so it is put only under the same tokens)."""

    column: int
    start: int
    token_ids: tuple[int, ...]
    values: tuple[torch.Tensor, ...]

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)

    def nbytes(self) -> int:
        return sum(v.numel() * v.element_size() for v in self.values)

    @classmethod
    @torch.no_grad()
    def take(
        cls, buffers: Sequence[torch.Tensor], slots: torch.Tensor, column: int, start: int, token_ids: Sequence[int]
    ) -> "OwnLRColumn":
        """Copy column ``column`` of ``buffers`` at ``slots`` [n] (int64; the rows of positions
        ``start .. start + n - 1``, tokens ``token_ids``)."""
        if slots.numel() != len(token_ids):
            raise ValueError(f"{slots.numel()} slots for {len(token_ids)} tokens")
        return cls(
            column, start, tuple(int(t) for t in token_ids), tuple(buf[slots, column].clone() for buf in buffers)
        )

    @torch.no_grad()
    def put(self, buffers: Sequence[torch.Tensor], slots: torch.Tensor, start: int, token_ids: Sequence[int]) -> int:
        """Write the kept column onto ``slots`` [n] (int64), the rows of positions
        ``start .. start + n - 1`` holding ``token_ids``: on the positions both cover, up to the
        first whose token differs (the hidden states past it differ). Returns the rows written;
        ValueError when the buffers are not those it was taken from (count, rank)."""
        if (
            slots.numel() != len(token_ids)
            or len(buffers) != len(self.values)
            or any(b.shape[2:] != v.shape[1:] for b, v in zip(buffers, self.values))
        ):
            raise ValueError(
                f"{slots.numel()} slots for {len(token_ids)} tokens; buffers "
                f"{[tuple(b.shape) for b in buffers]} for kept {[tuple(v.shape) for v in self.values]}"
            )
        span = own_span((self.start, self.end), (start, start + len(token_ids)))
        if span is None:
            return 0
        lo, hi = span
        for p in range(lo, hi):
            if self.token_ids[p - self.start] != int(token_ids[p - start]):
                hi = p
                break
        if lo >= hi:
            return 0
        dst = slots[lo - start : hi - start]
        for buf, val in zip(buffers, self.values):
            buf[dst, self.column] = val[lo - self.start : hi - self.start].to(buf.device, buf.dtype)
        return hi - lo
