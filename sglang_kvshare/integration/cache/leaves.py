"""KV leaves: an accepted KVCMAS correction kept as a low-rank leaf beside the source's KV
(``--kvshare-leaf-rank``), instead of a corrected copy in new slots.

A later agent reads the shared segment in the source's slots (a KV view, ``views.py``) and its
correction as ``A @ B`` per layer (keys and values, rank ``--kvshare-leaf-rank``, keys in the
RoPE frame the cached rows carry). A leaf belongs to (agent, slot): a later prefix hit of the
agent's tree node, which holds the source's slots, reads them with the agent's leaf; another
agent reading the same slots does not. A reader of a view whose source agent has leaves on its
slots inherits them (the same factors, no copy), so a chain of agents (KVCMAS's workflow edges)
reads what the copy would have held. A reader that would need other leaves on slots where it
already has some (two different corrections of one slot for one agent) copies instead.

Entries are dropped when their slot is freed (its last holder released it); a leaf whose rows are
all gone is deleted. The bytes of live leaves are reported (``leaf_bytes``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from sglang_kvshare.kernels.kv_leaf import KeyLeaf
from sglang_kvshare.lowrank import LowRank, randomized_svd
from sglang_kvshare.rope import RopeSpec, rotate_keys_


@dataclass
class Leaf:
    """Factors of one corrected segment: ``k``, ``v`` LowRank A [L, n, r], B [L, r, H * D];
    ``live``: (agent, slot) entries that point at it."""

    k: LowRank
    v: LowRank
    live: int = 0

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


class KVLeaves:
    """Per agent and slot of a token-to-KV pool of ``num_slots`` rows: which leaf (and row of it)
    corrects the slot's K/V when that agent reads it."""

    def __init__(self, num_slots: int, device) -> None:
        self.num_slots, self.device = num_slots, device
        self.ids: dict[str, torch.Tensor] = {}  # agent -> [num_slots] leaf id, -1: none
        self.rows: dict[str, torch.Tensor] = {}  # agent -> [num_slots] row of that leaf
        self.leaves: dict[int, Leaf] = {}
        self._next = 0

    def clear(self) -> None:
        self.ids.clear()
        self.rows.clear()
        self.leaves.clear()

    def _tables(self, agent: str):
        if agent not in self.ids:
            self.ids[agent] = torch.full((self.num_slots,), -1, dtype=torch.int64, device=self.device)
            self.rows[agent] = torch.zeros(self.num_slots, dtype=torch.int64, device=self.device)
        return self.ids[agent], self.rows[agent]

    def has(self, agent: str, slots: torch.Tensor) -> bool:
        """Whether ``agent`` has a leaf on any of ``slots``."""
        ids = self.ids.get(agent)
        return ids is not None and bool((ids[slots] >= 0).any())

    def compatible(self, source: str, reader: str, slots: torch.Tensor) -> bool:
        """Whether ``reader`` may read ``slots`` as ``source`` does: it has no leaf on them, or
        the same ones."""
        if source == reader or reader not in self.ids:
            return True
        mine = self.ids[reader][slots]
        theirs = self.ids[source][slots] if source in self.ids else torch.full_like(mine, -1)
        return bool(((mine < 0) | (mine == theirs)).all())

    def attach(self, agent: str, slots: torch.Tensor, k: LowRank, v: LowRank) -> None:
        """``agent`` reads ``slots`` [n] corrected by k, v (A [L, n, r]); it has no leaf on them."""
        ids, rows = self._tables(agent)
        leaf_id, self._next = self._next, self._next + 1
        self.leaves[leaf_id] = Leaf(k, v, live=slots.numel())
        ids[slots] = leaf_id
        rows[slots] = torch.arange(slots.numel(), device=ids.device)

    def inherit(self, source: str, reader: str, slots: torch.Tensor) -> None:
        """``reader`` now reads ``slots`` as ``source`` does (``compatible``): it gets the
        source's leaves on them."""
        if source == reader or source not in self.ids:
            return
        theirs = self.ids[source][slots]
        have = theirs >= 0
        if not bool(have.any()):
            return
        ids, rows = self._tables(reader)
        new = have & (ids[slots] < 0)
        take = slots[new]
        ids[take] = theirs[new]
        rows[take] = self.rows[source][take]
        for leaf_id, count in zip(*torch.unique(theirs[new], return_counts=True)):
            self.leaves[int(leaf_id)].live += int(count)

    def drop(self, slots: torch.Tensor) -> None:
        """``slots`` were freed: every agent's entries on them go."""
        for ids in self.ids.values():
            held = ids[slots]
            held = held[held >= 0]
            if held.numel() == 0:
                continue
            ids[slots] = -1
            for leaf_id, count in zip(*torch.unique(held, return_counts=True)):
                leaf = self.leaves[int(leaf_id)]
                leaf.live -= int(count)
                if leaf.live <= 0:
                    del self.leaves[int(leaf_id)]

    def key_leaf(self, agent: str, slots: torch.Tensor) -> Optional[KeyLeaf]:
        """``agent``'s leaves on a request's ``slots`` [n] as one ``KeyLeaf`` (positions into
        ``slots``, each leaf's factors as stored), or None."""
        ids = self.ids.get(agent)
        if ids is None:
            return None
        slots = slots.to(torch.int64)
        mine = ids[slots]
        pos = torch.nonzero(mine >= 0).flatten()
        if pos.numel() == 0:
            return None
        held, which = torch.unique(mine[pos], return_inverse=True)
        found = [self.leaves[i] for i in held.tolist()]
        return KeyLeaf(pos, which, self.rows[agent][slots[pos]], tuple(f.k for f in found), tuple(f.v for f in found))

    def add_to(
        self,
        agent: str,
        slots: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        dim: int = 0,
        key_shift: int = 0,
        rope: Optional[RopeSpec] = None,
        head_dim: Optional[int] = None,
    ) -> bool:
        """Add ``agent``'s leaves on ``slots`` [n] to float32 k, v gathered from them (``[L, n,
        H, D]`` or ``[L, n, H * D]`` with ``dim=0``, ``[n, L, H, D]`` with ``dim=1``), in place;
        the keys' leaves turned by ``key_shift`` positions first (``rope``; ``head_dim`` for
        the flat layout): one map of B, so a leaf reaches another RoPE frame without a pass over
        the dense rows. False when it has none."""
        leaf = self.key_leaf(agent, slots)
        if leaf is None:
            return False
        for x, factors, shift in ((k, leaf.k, key_shift), (v, leaf.v, 0)):
            rows_first = x if dim == 0 else x.transpose(0, 1)
            flat = rows_first.flatten(2) if rows_first.dim() == 4 else rows_first  # a view: [L, n, H*D]
            for j, f in enumerate(factors):
                mine = leaf.which == j
                B = f.B.float()
                if shift:
                    D = rows_first.shape[-1] if rows_first.dim() == 4 else head_dim
                    B = rotate_keys_(B.reshape(-1, B.shape[-1] // D, D).clone(), shift, rope).view(B.shape)
                pos, rows = leaf.pos[mine], leaf.rows[mine]
                if _consecutive(pos) and _consecutive(rows):  # one pass, no product tensor (7x faster at 2K)
                    p, r = int(pos[0]), int(rows[0])
                    flat[:, p : p + pos.numel()].baddbmm_(f.A[:, r : r + rows.numel()].float(), B)
                else:
                    flat.index_add_(1, pos, f.A[:, rows].float() @ B)
        return True

    def stats(self) -> dict:
        return {"leaves": len(self.leaves), "leaf_bytes": sum(f.nbytes for f in self.leaves.values())}


def _consecutive(x: torch.Tensor) -> bool:
    return bool((x[1:] - x[:-1] == 1).all())


def uniform_offset(rope_pos: torch.Tensor, start: int) -> Optional[int]:
    """The RoPE position of row 0 of a segment whose row t carries ``rope_pos[t]`` (-1: the
    source's own position ``start + t``), when every row is that plus t (a leaf's keys are then
    turned by one angle); None otherwise."""
    t = torch.arange(rope_pos.numel(), device=rope_pos.device)
    first = torch.where(rope_pos >= 0, rope_pos, start + t) - t
    return int(first[0]) if bool((first == first[0]).all()) else None


@torch.no_grad()
def leaf_factors(
    delta_k: torch.Tensor, delta_v: torch.Tensor, p0: int, rank: int, rope: RopeSpec, head_dim: int, dtype: torch.dtype
) -> tuple[LowRank, LowRank]:
    """Rank-``rank`` leaves (randomized truncated SVD per layer) of a canonical correction ``delta_k``,
    ``delta_v`` [L, n, H*D] (float32, keys RoPE'd at 0 .. n-1) for rows whose keys carry RoPE at
    ``p0 + t``: the key factor's rows turned by ``p0`` (one orthogonal map: rank and error as in
    the canonical frame). A in ``dtype``, B float32."""
    fk, fv = randomized_svd(delta_k, rank, dtype), randomized_svd(delta_v, rank, dtype)
    L, r, HD = fk.B.shape
    B = rotate_keys_(fk.B.reshape(L * r, HD // head_dim, head_dim).clone(), p0, rope).reshape(L, r, HD)
    return LowRank(fk.A, B), fv
