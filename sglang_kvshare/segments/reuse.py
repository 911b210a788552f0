"""How long a shared source must stay cached to be read again, and whether a copy costs reuse.

A later agent reads a source's cache one turn after it was written or last read. An LRU cache
(SGLang's radix tree) keeps what was used within its *characteristic time*: the age of the
entries it would evict next. While that age exceeds the reuse distance, writing more (a
corrected copy instead of a KV leaf) evicts only entries that are not read again; once it
falls below, each copy pushes out a source that a workflow in flight still needs. Entries
that no reader will start from again (a chained source that a later agent superseded) are
not protected, however recently they were read. Plain bookkeeping, no tensors: the tree
(``integration/cache/radix.py``) supplies its free slots, its nodes and which are spent.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections import Counter, deque
from typing import Callable, Hashable, Iterable, Optional

from cachetools import LRUCache


class ReuseClock:
    """Times between consecutive uses of each source (written, then read by a later agent,
    read again...): the last ``window`` of them."""

    def __init__(self, window: int = 64, max_sources: int = 4096, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.gaps: deque[float] = deque(maxlen=window)
        self._last: LRUCache = LRUCache(max_sources)

    def touch(self, source: Hashable) -> Optional[float]:
        """``source`` is used now; returns the time since its last use (None: first use)."""
        now = self.clock()
        last = self._last.get(source)
        self._last[source] = now
        if last is None:
            return None
        self.gaps.append(now - last)
        return now - last

    def horizon(self, q: float = 0.9) -> Optional[float]:
        """The ``q`` quantile (nearest rank) of the recent reuse gaps; None before any reuse."""
        if not self.gaps:
            return None
        ordered = sorted(self.gaps)
        return ordered[max(math.ceil(q * len(ordered)) - 1, 0)]


def copies_fit(free: int, rows: int, lru_age: Optional[float], horizon: Optional[float]) -> bool:
    """Whether writing ``rows`` more KV rows evicts nothing that is read again: the pool has
    ``free`` slots for them, or the youngest of the entries eviction would take for them was
    last used ``lru_age`` seconds ago, longer than the reuse ``horizon`` (no horizon: nothing
    has been read again yet). Too little evictable (``lru_age`` None): they do not fit."""
    if free >= rows:
        return True
    if lru_age is None:
        return False
    return horizon is None or lru_age > horizon


def lru_victims(leaves: Iterable, rows: int, priority: Callable) -> Optional[list]:
    """The tree nodes that eviction would free, in its order, to make ``rows`` slots: evictable
    leaves by ``priority`` (least recently used first), a parent once its last child went and
    nothing locks it. Nodes have ``value`` (their slots), ``parent``, ``children``, ``lock_ref``.
    None when all of them together hold fewer than ``rows`` slots."""
    tie = itertools.count()
    heap = [(priority(n), next(tie), n) for n in leaves]
    heapq.heapify(heap)
    gone: Counter = Counter()
    victims, taken = [], 0
    while taken < rows:
        if not heap:
            return None
        _, _, node = heapq.heappop(heap)
        victims.append(node)
        taken += len(node.value)
        parent = node.parent
        gone[id(parent)] += 1
        if (
            parent is not None
            and parent.parent is not None
            and parent.lock_ref == 0
            and gone[id(parent)] == len(parent.children)
        ):
            heapq.heappush(heap, (priority(parent), next(tie), parent))
    return victims
