"""Repeated token spans within a scope (``--kvshare-auto``): plain bookkeeping over token ids.

A :class:`ScopeIndex` holds the token ids a scope sent and produced: an :class:`Entry` per request
*sequence* (prompt, then output; the scheduler caches it under the key ``seq:<n>``).
:meth:`ScopeIndex.find` returns every maximal run of >= ``min_tokens`` tokens of a new prompt that
equals a run of an entry, at any position on either side: ``k``-gram seeds sampled every ``k``
tokens of an entry (any common run of ``2k - 1`` tokens holds one) are extended both ways; the
longest run at the leftmost uncovered position wins (ties: the most recent, the chained source).

Slot names: every indexed token carries the *label* of where its text first appeared in the
scope (``segments.labels``); a run is cut where its source's labels change.

:class:`TokenIndex` keeps the scopes within a token budget per scope and in total (each token
costs ~``BYTES_PER_TOKEN``), forgetting the oldest entries first, least recently used scope first.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional, Sequence

from sglang_kvshare.segments.labels import merge_short

# a k-gram seed's candidates kept per hash (newest); more would only be older copies of a run
MAX_HITS = 8
# the ids (4 bytes each, an array), the sampled seeds (~150 bytes per k = 16 tokens), the labels
BYTES_PER_TOKEN = 16


def seed_len(min_tokens: int) -> int:
    """k: any common run of ``min_tokens`` tokens contains a whole sampled seed (2k - 1 <= it)."""
    return max(1, min(16, (min_tokens + 1) // 2))


def common_run(a: Sequence[int], i: int, b: Sequence[int], j: int) -> int:
    """Length of the common run of ``a[i:]`` and ``b[j:]`` (compared 64 at a time)."""
    n, m = 0, min(64, len(a) - i, len(b) - j)
    while m > 0 and a[i + n : i + n + m] == b[j + n : j + n + m]:
        n, m = n + m, min(64, len(a) - i - n - m, len(b) - j - n - m)
    return n + next((t for t in range(max(m, 0)) if a[i + n + t] != b[j + n + t]), max(m, 0))


@dataclass
class Entry:
    """One request's prompt or output: ``ids`` at positions ``offset:`` of sequence ``key``. An
    output indexed after its prompt extends the prompt's entry (``output_start``), so that a run
    goes on from a prompt into the answer that followed it."""

    key: str
    agent: str
    kind: str  # "prompt" or "output"
    offset: int
    ids: array  # of "i"
    labels: list[tuple[int, int, str]]  # (start, end, label) over ``ids``, in order, covering them
    number: int = 0  # order of indexing in its scope
    seeds: list[int] = field(default_factory=list)
    output_start: Optional[int] = None  # where in ``ids`` an output appended to a prompt starts

    def kind_at(self, position: int) -> str:
        return "output" if self.output_start is not None and position >= self.output_start else self.kind

    def __post_init__(self) -> None:
        if not isinstance(self.ids, array):
            self.ids = array("i", self.ids)

    def label_parts(self, start: int, end: int) -> list[tuple[int, int, str]]:
        """``(start, end, label)`` of ``ids[start:end]`` cut where the labels change."""
        return [(max(a, start), min(b, end), lab) for a, b, lab in self.labels if a < end and start < b]


@dataclass(frozen=True)
class Run:
    """A detected run: prompt tokens ``[start, end)`` equal tokens ``[src_start, src_end)`` of the
    sequence ``source`` (agent ``source_agent``, in its ``source_kind``)."""

    start: int
    end: int
    slot: str
    label: str
    source: str
    source_agent: str
    source_kind: str
    src_start: int
    src_end: int

    def __len__(self) -> int:
        return self.end - self.start

    def record(self) -> dict:
        return {
            "slot": self.slot,
            "source_agent": self.source_agent,
            "source_kind": self.source_kind,
            "here": [self.start, self.end],
            "there": [self.src_start, self.src_end],
            "tokens": len(self),
        }


class ScopeIndex:
    """The entries of one scope and their sampled seeds (hash of a k-gram -> (entry, position))."""

    def __init__(self, k: int):
        self.k = k
        self.entries: OrderedDict[int, Entry] = OrderedDict()  # number -> entry, oldest first
        self.keys: dict[str, int] = {}  # sequence key -> its entry's number
        self.seeds: dict[int, list[tuple[int, int]]] = {}
        self.tokens = 0
        self.count = 0  # entries ever added (numbers are unique)
        self.requests = 0  # requests seen (whose prompt may have been too long to index)

    def add(self, entry: Entry) -> None:
        """Index ``entry``; an output right after its sequence's indexed prompt extends that."""
        before = self.entries.get(self.keys.get(entry.key, 0))
        if before is not None and entry.kind == "output" and before.offset + len(before.ids) == entry.offset:
            n = len(before.ids)
            before.output_start = n
            before.ids.extend(entry.ids)
            before.labels += [(a + n, b + n, label) for a, b, label in entry.labels]
            self.tokens += len(entry.ids)
            self._seed(before, (max(n - self.k, -1) // self.k + 1) * self.k)
            return
        self.count += 1
        entry.number = self.count
        self.entries[entry.number] = entry
        self.keys[entry.key] = entry.number
        self.tokens += len(entry.ids)
        self._seed(entry, 0)

    def _seed(self, entry: Entry, first: int) -> None:
        """Sample the seeds of ``entry`` from position ``first`` (on the grid of k) on."""
        k, ids = self.k, entry.ids
        for p in range(first, len(ids) - k + 1, k):
            h = hash(tuple(ids[p : p + k]))
            hits = self.seeds.setdefault(h, [])
            hits.append((entry.number, p))
            if len(hits) > MAX_HITS:
                del hits[0]
            entry.seeds.append(h)

    def pop_oldest(self) -> int:
        """Forget the oldest entry; returns its token count."""
        number, entry = self.entries.popitem(last=False)
        if self.keys.get(entry.key) == number:
            del self.keys[entry.key]
        for h in set(entry.seeds):
            hits = [x for x in self.seeds.get(h, ()) if x[0] != number]
            if hits:
                self.seeds[h] = hits
            else:
                self.seeds.pop(h, None)
        self.tokens -= len(entry.ids)
        return len(entry.ids)

    def find(self, ids: Sequence[int], min_tokens: int) -> list[Run]:
        """The runs of ``ids`` (non-overlapping, in order) that repeat indexed tokens, cut at their
        sources' label changes (a part shorter than k joins its neighbour), named by label
        (``#2``... when a label repeats)."""
        ids, k, n = array("i", ids), self.k, len(ids)
        found: list[tuple[int, int, Entry, int]] = []  # (start here, length, entry, start there)
        q = covered = 0
        while q + k <= n:
            best = None
            for number, p in reversed(self.seeds.get(hash(tuple(ids[q : q + k])), ())):
                entry = self.entries.get(number)
                if entry is None or entry.ids[p : p + k] != ids[q : q + k]:
                    continue
                back = 0
                while q - back > covered and p - back > 0 and ids[q - back - 1] == entry.ids[p - back - 1]:
                    back += 1
                length = back + k + common_run(ids, q + k, entry.ids, p + k)
                if best is None or length > best[1]:
                    best = (q - back, length, entry, p - back)
            if best is not None and best[1] >= min_tokens:
                found.append(best)
                q = covered = best[0] + best[1]
            else:
                q += 1
        runs, seen = [], {}
        for start, length, entry, there in found:
            for a, b, label in merge_short(entry.label_parts(there, there + length), k):
                seen[label] = seen.get(label, 0) + 1
                slot = label if seen[label] == 1 else f"{label}#{seen[label]}"
                here = start + a - there
                runs.append(
                    Run(
                        here,
                        here + b - a,
                        slot,
                        label,
                        entry.key,
                        entry.agent,
                        entry.kind_at(a),
                        entry.offset + a,
                        entry.offset + b,
                    )
                )
        return runs


class TokenIndex:
    """The scopes' indexes within ``scope_tokens`` per scope and ``total_tokens`` in all, and at
    most ``max_scopes`` scopes; the oldest entries go first, of the least recently used scope."""

    def __init__(self, min_tokens: int, scope_tokens: int, total_tokens: int, max_scopes: int):
        self.min_tokens, self.k = min_tokens, seed_len(min_tokens)
        self.scope_tokens, self.total_tokens, self.max_scopes = scope_tokens, total_tokens, max_scopes
        self.scopes: OrderedDict[str, ScopeIndex] = OrderedDict()
        self.tokens = 0
        self.keys = 0  # sequence keys handed out
        self.forgotten = 0  # entries forgotten to stay within the limits

    def scope(self, name: str) -> ScopeIndex:
        """The scope's index (new if needed), now the most recently used."""
        index = self.scopes.get(name)
        if index is None:
            while len(self.scopes) >= self.max_scopes:
                self._drop_scope(next(iter(self.scopes)))
            index = self.scopes[name] = ScopeIndex(self.k)
        self.scopes.move_to_end(name)
        return index

    def next_key(self, name: str) -> str:
        """A new request of scope ``name``: the key of its sequence, unique in this index (a
        scope forgotten and seen again does not reuse its keys)."""
        self.scope(name).requests += 1
        self.keys += 1
        return f"seq:{self.keys}"

    def find(self, name: str, ids: Sequence[int]) -> list[Run]:
        index = self.scopes.get(name)
        return [] if index is None else index.find(ids, self.min_tokens)

    def add(self, name: str, entry: Entry) -> bool:
        """Index ``entry`` in scope ``name``, forgetting what the limits need; False (nothing
        indexed) when it alone exceeds a limit or is shorter than a seed."""
        if len(entry.ids) < self.k or len(entry.ids) > min(self.scope_tokens, self.total_tokens):
            return False
        index = self.scope(name)
        while index.tokens + len(entry.ids) > self.scope_tokens:
            self._forget(index)
        while self.tokens + len(entry.ids) > self.total_tokens:
            oldest = next(iter(self.scopes.values()))
            if not oldest.entries:
                self._drop_scope(next(iter(self.scopes)))
                continue
            self._forget(oldest)
        index.add(entry)
        self.tokens += len(entry.ids)
        return True

    def _forget(self, index: ScopeIndex) -> None:
        self.tokens -= index.pop_oldest()
        self.forgotten += 1

    def _drop_scope(self, name: str) -> None:
        index = self.scopes.pop(name)
        self.tokens -= index.tokens
        self.forgotten += len(index.entries)

    def info(self) -> dict:
        """What ``/server_info`` shows (``kvshare_auto_index``)."""
        return {
            "scopes": len(self.scopes),
            "entries": sum(len(s.entries) for s in self.scopes.values()),
            "tokens": self.tokens,
            "bytes": self.tokens * BYTES_PER_TOKEN,
            "forgotten_entries": self.forgotten,
            "largest_scope_tokens": max((s.tokens for s in self.scopes.values()), default=0),
            "limit_scope_tokens": self.scope_tokens,
            "limit_total_tokens": self.total_tokens,
            "min_tokens": self.min_tokens,
            "seed_tokens": self.k,
        }
