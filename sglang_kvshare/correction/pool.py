"""Per-slot anchor pools: what an anchor stores, insertion, lookup, LFU-among-oldest eviction."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Tuple

import torch

from sglang_kvshare.correction.base import SegmentKV
from sglang_kvshare.lowrank import Factor

Fingerprint = Tuple


def fingerprint(kv: SegmentKV) -> Fingerprint:
    """A cheap content identity of a cache: equal tensors give equal fingerprints.

    Used to recognise a second consumer of the same observed segment instance (fan-out), whose
    delta then joins the existing anchor instead of creating a duplicate base.
    """
    return (
        tuple(kv.k.shape),
        float(kv.k.sum(dtype=torch.float64)),
        float(kv.v.sum(dtype=torch.float64)),
        float(torch.linalg.vector_norm(kv.v, dtype=torch.float64)),
    )


@dataclass(eq=False)
class Anchor:
    """One observed instance of a slot's segment.

    base_k, base_v: factors of the base cache [n_layers, L, D] (the source agent cache when
        chained, the context-free reference otherwise).
    deltas: consuming target agent -> (delta_k, delta_v) factors, [n_layers, L, D] each.
    serial: insertion order within the pool (smaller = older). use_count: accepted corrections
        this anchor took part in. Only the owning pool and its corrector mutate an anchor.
    """

    base_k: Factor
    base_v: Factor
    deltas: Dict[str, Tuple[Factor, Factor]]
    source_agent: Optional[str]
    key: Fingerprint
    serial: int = 0
    use_count: int = 0
    born: int = field(default_factory=time.monotonic_ns)

    @property
    def seq_len(self) -> int:
        return self.base_k.rows

    @property
    def nbytes(self) -> int:
        n = self.base_k.nbytes + self.base_v.nbytes
        return n + sum(dk.nbytes + dv.nbytes for dk, dv in self.deltas.values())


@dataclass
class AnchorPool:
    """Up to ``capacity`` anchors of one slot, oldest first.

    When full, an insert evicts the anchor with the smallest use_count among the
    ``num_oldest`` oldest (ties: the oldest), as KVComm does. ``max_bytes`` (optional) evicts
    the same way until the pool fits, but never the anchor just inserted.
    """

    capacity: int
    num_oldest: int = 5
    max_bytes: Optional[int] = None
    anchors: List[Anchor] = field(default_factory=list)
    _next_serial: int = 0

    def __post_init__(self) -> None:
        if self.capacity < 1 or self.num_oldest < 1:
            raise ValueError("capacity and num_oldest must be >= 1")

    def __len__(self) -> int:
        return len(self.anchors)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.anchors)

    def find(self, key: Fingerprint, source_agent: Optional[str]) -> Optional[Anchor]:
        for a in self.anchors:
            if a.key == key and a.source_agent == source_agent:
                return a
        return None

    def compatible(self, target_agent: str) -> List[Anchor]:
        """Anchors holding a delta for ``target_agent``, oldest first."""
        return [a for a in self.anchors if target_agent in a.deltas]

    def victim(self, keep: Optional[Anchor] = None) -> Anchor:
        """The anchor an insert would evict now (pool non-empty; ``keep`` is never chosen)."""
        oldest = [a for a in self.anchors if a is not keep][: self.num_oldest]
        return min(oldest, key=lambda a: (a.use_count, a.serial))

    def insert(self, anchor: Anchor) -> List[Anchor]:
        """Add ``anchor`` (sets its serial); returns the evicted anchors, oldest decision first."""
        evicted = []
        while len(self.anchors) >= self.capacity:
            evicted.append(self.evict())
        anchor.serial = self._next_serial
        self._next_serial += 1
        self.anchors.append(anchor)
        if self.max_bytes is not None:
            while len(self.anchors) > 1 and self.nbytes > self.max_bytes:
                evicted.append(self.evict(keep=anchor))
        return evicted

    def evict(self, keep: Optional[Anchor] = None) -> Anchor:
        """Remove and return ``victim(keep)``."""
        v = self.victim(keep)
        self.anchors.remove(v)
        return v


def evict_lfu_oldest(correctors: Iterable, max_bytes: int, num_oldest: int = 5, keep: Iterable[Anchor] = ()) -> int:
    """Evict anchors of ``correctors`` (objects with ``anchors()``, ``remove(slot, anchor)`` and
    ``nbytes()``) until their bytes fit ``max_bytes``: each time the least used of the
    ``num_oldest`` oldest anchors of all their pools (ties: the oldest), never one in ``keep``.

    This is the paper's per-slot rule (LFU among the five oldest) applied to one byte budget over
    all slots, so a slot of long segments loses its anchors at the rate of every other slot rather
    than first. Returns the number evicted.
    """
    correctors = list(correctors)
    keep_ids = {id(a) for a in keep}
    evicted = 0
    while sum(c.nbytes() for c in correctors) > max_bytes:
        candidates = [(a, c, slot) for c in correctors for slot, a in c.anchors() if id(a) not in keep_ids]
        if not candidates:
            break
        oldest = sorted(candidates, key=lambda x: x[0].born)[:num_oldest]
        anchor, owner, slot = min(oldest, key=lambda x: (x[0].use_count, x[0].born))
        owner.remove(slot, anchor)
        evicted += 1
    return evicted


def bytes_per_token(members: List[Anchor], target_agent: str) -> Optional[float]:
    """Mean over ``members`` of (base + the target's delta) bytes per covered token."""
    if not members:
        return None
    total = 0.0
    for a in members:
        dk, dv = a.deltas[target_agent]
        total += (a.base_k.nbytes + a.base_v.nbytes + dk.nbytes + dv.nbytes) / a.seq_len
    return total / len(members)
