"""Which materialised cache is the source of each shared slot in a workflow.

Plain bookkeeping (no tensors): a record names the token path under which the source agent's
cache sits in the radix tree, and where the slot's tokens are on that path. The tree may have
evicted the cache since: a record is a hint, the tree lookup is the truth.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

from cachetools import FIFOCache, LRUCache


# The agent name under which a workflow's context-free reference caches are recorded.
REFERENCE_AGENT = "__reference__"


def common_prefix(a, b) -> int:
    """Length of the common leading run of two token sequences."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def common_suffix(a, b, limit: int) -> int:
    """Length of the common trailing run of two token sequences, counted up to ``limit``."""
    n = 0
    while n < min(limit, len(a), len(b)) and a[len(a) - 1 - n] == b[len(b) - 1 - n]:
        n += 1
    return n


@dataclass(frozen=True)
class SourceRecord:
    agent: str
    namespace: str  # radix-tree extra_key of the source cache (with the LoRA id, if any)
    token_ids: tuple[int, ...]  # the source path, from position 0 to at least ``end``
    start: int  # the slot's tokens are token_ids[start:end]
    end: int

    def head_rows(self, window: int, tokens, start: int) -> int:
        """Rows of this slot, read at ``tokens[start:]``, that lie within ``window`` tokens after
        the point where ``tokens`` diverge from the source path before the slot: ``window`` less
        the tokens that precede the slot alike in both (``--kvshare-recompute-head``)."""
        if window <= 0:
            return 0
        before = self.token_ids[max(0, self.start - window) : self.start]
        alike = common_suffix(before, tokens[max(0, start - window) : start], window)
        if start == self.start == alike:  # the same tokens from position 0: nothing diverges
            return 0
        return window - alike

    @property
    def key(self) -> tuple[str, int, int]:
        """A small identity of the record (its namespace names the workflow and agent)."""
        return self.namespace, self.start, self.end


class SourceRegistry:
    """Per workflow, per slot: the materialised caches, most recent last; and per workflow the
    whole sequences of the requests that automatic detection reads at any offset (the newest, up
    to ``sequence_tokens`` tokens in all).

    Workflows are forgotten least-recently-used first beyond ``max_workflows``. A chained reader
    starts from the most recent agent's record of a slot, so a record is *superseded* once
    another agent records the slot after it; a namespace whose records are all superseded is
    :meth:`spent`.
    """

    def __init__(self, max_workflows: int = 4096, sequence_tokens: int = 1 << 23):
        self.max_workflows = max_workflows
        self.sequence_tokens = sequence_tokens
        self._sequences: OrderedDict[tuple[str, str], SourceRecord] = OrderedDict()  # oldest first
        self._sequence_total = 0
        # workflow -> slot -> records; recording into a workflow makes it the most recent
        self._flows: FIFOCache = FIFOCache(max_workflows)
        # namespace -> number of slots whose most recent agent record is in it
        self._latest: LRUCache = LRUCache(16 * max_workflows)

    def record(self, workflow: str, slot: str, rec: SourceRecord) -> None:
        slots = self._flows.get(workflow, {})
        self._flows[workflow] = slots
        old = slots.get(slot, [])
        if rec.agent != REFERENCE_AGENT:
            prev = self.lookup(workflow, slot)  # the record ``rec`` supersedes
            if prev is not None:
                self._latest[prev.namespace] = max(self._latest.get(prev.namespace, 1) - 1, 0)
            self._latest[rec.namespace] = self._latest.get(rec.namespace, 0) + 1
        recs = [r for r in old if r.agent != rec.agent]
        recs.append(rec)
        slots[slot] = recs

    def record_sequence(self, workflow: str, key: str, rec: SourceRecord) -> None:
        """Keep a request's whole sequence; the oldest go beyond ``sequence_tokens`` in all."""
        old = self._sequences.pop((workflow, key), None)
        self._sequence_total += len(rec.token_ids) - (len(old.token_ids) if old is not None else 0)
        self._sequences[(workflow, key)] = rec
        while self._sequence_total > self.sequence_tokens and len(self._sequences) > 1:
            self._sequence_total -= len(self._sequences.popitem(last=False)[1].token_ids)

    def in_sequence(self, workflow: str, key: str, start: int, end: int) -> Optional[SourceRecord]:
        """Tokens [start, end) of the sequence ``key`` as a record (cut where the sequence ends);
        None when it was not recorded, or forgotten."""
        rec = self._sequences.get((workflow, key))
        end = min(end, len(rec.token_ids)) if rec is not None else 0
        if end <= start:
            return None
        return SourceRecord(rec.agent, rec.namespace, rec.token_ids[:end], start, end)

    def spent(self, namespace: str) -> bool:
        """Whether every record of ``namespace`` was superseded, so that no chained reader
        starts from it again. A reader naming its source agent (``kvshare.sources``) may still;
        unknown namespaces and reference records are never spent."""
        return self._latest.get(namespace) == 0

    def lookup(
        self, workflow: str, slot: str, agent: Optional[str] = None, exclude: Optional[str] = None
    ) -> Optional[SourceRecord]:
        """The record of ``agent`` for the slot, or the most recent agent's one not by ``exclude``.

        Reference records are returned only when asked for by name (``REFERENCE_AGENT``).
        """
        recs = self._flows.get(workflow, {}).get(slot, [])
        for rec in reversed(recs):
            if agent is not None:
                if rec.agent == agent:
                    return rec
                continue
            if rec.agent == REFERENCE_AGENT or (exclude is not None and rec.agent == exclude):
                continue
            return rec
        return None

    def has(self, workflow: str, slot: str, agent: Optional[str] = None, exclude: Optional[str] = None) -> bool:
        return self.lookup(workflow, slot, agent, exclude) is not None
