"""Which materialised cache is the source of each shared slot in a workflow.

Plain bookkeeping (no tensors): a record names the token path under which the source agent's
cache sits in the radix tree, and where the slot's tokens are on that path. The tree may have
evicted the cache since: a record is a hint, the tree lookup is the truth.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from cachetools import FIFOCache


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


@dataclass(frozen=True)
class SourceRecord:
    agent: str
    namespace: str  # radix-tree extra_key of the source cache (with the LoRA id, if any)
    token_ids: tuple[int, ...]  # the source path, from position 0 to at least ``end``
    start: int  # the slot's tokens are token_ids[start:end]
    end: int

    @property
    def key(self) -> tuple[str, int, int]:
        """A small identity of the record (its namespace names the workflow and agent)."""
        return self.namespace, self.start, self.end


class SourceRegistry:
    """Per workflow, per slot: the materialised caches, most recent last.

    Workflows are forgotten least-recently-used first beyond ``max_workflows``.
    """

    def __init__(self, max_workflows: int = 4096):
        self.max_workflows = max_workflows
        # workflow -> slot -> records; recording into a workflow makes it the most recent
        self._flows: FIFOCache = FIFOCache(max_workflows)

    def record(self, workflow: str, slot: str, rec: SourceRecord) -> None:
        slots = self._flows.get(workflow, {})
        self._flows[workflow] = slots
        recs = [r for r in slots.get(slot, []) if r.agent != rec.agent]
        recs.append(rec)
        slots[slot] = recs

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
