"""Per-request segment state of an annotated request in the scheduler process (``ReqShareState``).

The process-wide state (config, correctors, source registry, ...) is the ``Session``
(``session.py``); SGLang runs its scheduling loop on one thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from sglang_kvshare.methods import MethodSpec
from sglang_kvshare.segments import Span, WireSpec
from sglang_kvshare.segments.sources import REFERENCE_AGENT, SourceRecord, SourceRegistry
from sglang_kvshare.segments.wire import KEY, output_slot


def wire_spec_of(req) -> Optional[WireSpec]:
    """The segment annotation a scheduler request (``Req`` or ``GenerateReqInput``) carries in
    its sampling parameters' ``custom_params``; None if unannotated."""
    params = getattr(req.sampling_params, "custom_params", None)
    if not isinstance(params, dict) or KEY not in params:
        return None
    return WireSpec.loads(params[KEY])


@dataclass
class ReqShareState:
    """What the plugin knows and did for one annotated request."""

    spec: WireSpec
    method: MethodSpec
    prompt_len: int
    # per span index: "computed" | "cached" | "injected" | "corrected" | "dense_fallback" |
    # "recomputed"; injected token counts
    modes: dict[int, str] = field(default_factory=dict)
    injected: dict[int, int] = field(default_factory=dict)
    view_tokens: int = 0  # of those, tokens read in the source's slots (KV views)
    inject_ms: float = 0.0  # scheduler time spent injecting (view or copy)
    sources: dict[int, str] = field(default_factory=dict)
    decided: set[int] = field(default_factory=set)  # PH spans whose injection was tried
    # per span index: gate outcome of a correction method (entropy, reason, corrected rows)
    corrections: dict[int, dict[str, Any]] = field(default_factory=dict)
    # per span index: what a dense fallback must report to the corrector once its KV exists
    pending: dict[int, Any] = field(default_factory=dict)
    # per span index: selective recomputation (budget, token-layers) and its running jobs
    recompute: dict[int, dict[str, Any]] = field(default_factory=dict)
    jobs: dict[int, Any] = field(default_factory=dict)
    first_prefix_len: Optional[int] = None
    anchor_bytes: Optional[int] = None  # bytes of the method's correction state, last seen
    correction_ms: float = 0.0  # scheduler time spent gathering, gating, correcting, writing
    kv_bytes_per_token: Optional[int] = None  # of the KV pool, set by a correction
    computed_tokens: int = 0  # tokens of the request's extends (what SGLang ran)
    # tokens of those extends whose KV was reused: corrected rows of a partial fallback's job
    reused_in_extend: int = 0
    meta: dict[str, Any] = field(default_factory=dict)
    ranged: dict[str, SourceRecord] = field(default_factory=dict)  # slot -> its sequence range, once found
    # head rows (``--kvshare-recompute-head``): the window of a correction method, and per span
    # index the rows the chunk before its sharing computes densely (fixed when first asked)
    head_window: int = 0
    heads: dict[int, int] = field(default_factory=dict)

    def source(self, registry: SourceRegistry, slot: str) -> Optional[SourceRecord]:
        """The cache to start from for ``slot``: the named or most recent agent's, or, for
        methods that correct a context-free reference, the reference when no agent has one. A
        detected slot (``spec.ranges``) is its range of an earlier request's sequence."""
        where = self.spec.ranges.get(slot)
        if where is not None:
            if slot not in self.ranged:
                rec = registry.in_sequence(self.spec.workflow, *where)
                if rec is None:
                    return None
                self.ranged[slot] = rec
            return self.ranged[slot]
        rec = registry.lookup(self.spec.workflow, slot, self.spec.sources.get(slot))
        if rec is None and self.method.needs_reference:
            rec = self.reference(registry, slot)
        return rec

    def reference(self, registry: SourceRegistry, slot: str) -> Optional[SourceRecord]:
        return registry.lookup(self.spec.workflow, slot, REFERENCE_AGENT)

    def injectable_starts(self, registry: SourceRegistry) -> list[tuple[int, Span]]:
        """PH spans (index, span) that may be injected: not at position 0, a source recorded."""
        if not self.method.injects:
            return []
        return [
            (i, s)
            for i, s in enumerate(self.spec.spans)
            if s.shared and s.start >= 1 and i not in self.decided and self.source(registry, s.slot)
        ]

    def share_at(self, registry: SourceRegistry, index: int, span: Span, tokens) -> int:
        """Where sharing ``span`` (injectable, ``tokens`` the prompt) starts: its start, or past
        its head rows, which the chunk before it computes densely (``head_window`` tokens after
        the point where the prompt and the source's path diverge, ``SourceRecord.head_rows``)."""
        if index not in self.heads:
            rec = self.source(registry, span.slot) if self.head_window else None
            head = 0 if rec is None else rec.head_rows(self.head_window, tokens, span.start)
            self.heads[index] = min(head, len(span))
        return span.start + self.heads[index]

    def next_cut(self, registry: SourceRegistry, after: int, tokens) -> Optional[int]:
        """First position > ``after`` where sharing a PH span starts (``share_at``)."""
        starts = [
            at for i, s in self.injectable_starts(registry) if (at := self.share_at(registry, i, s, tokens)) > after
        ]
        return min(starts) if starts else None

    def cached_slots(self, owned: int) -> list[tuple[str, int, int]]:
        """(slot, start, end) of each shared span, and of the output (``out:<agent>``), whose KV
        the first ``owned`` tokens of the released request cover."""
        slots = [(s.slot, s.start, s.end) for s in self.spec.spans if s.shared and s.end <= owned]
        if owned > self.prompt_len:
            slots.append((output_slot(self.spec.agent), self.prompt_len, owned))
        return slots

    def refresh_meta(self) -> dict[str, Any]:
        segs = []
        injected_total = 0
        for i, s in enumerate(self.spec.spans):
            n_inj = self.injected.get(i, 0)
            injected_total += n_inj
            mode = self.modes.get(i)
            if mode is None:
                cached = self.first_prefix_len is not None and s.end <= self.first_prefix_len
                mode = "cached" if cached else "computed"
            entry = {"tokens": len(s), "shared": s.shared, "mode": mode}
            if s.shared:
                entry["slot"] = s.slot
            if n_inj:
                entry["injected_tokens"] = n_inj
            if i in self.sources:
                entry["source_agent"] = self.sources[i]
            if i in self.corrections:
                entry.update(self.corrections[i])
            if i in self.recompute:
                if i in self.jobs:
                    job = self.jobs[i]
                    self.recompute[i].update(
                        recomputed_token_layers=job.token_layers, layer_groups=[list(g) for g in job.layer_groups]
                    )
                entry.update(self.recompute[i])
            segs.append(entry)
        computed = max(self.computed_tokens - self.reused_in_extend, 0)
        self.meta.update(
            method=self.method.name,
            workflow=self.spec.workflow,
            agent=self.spec.agent,
            prompt_tokens=self.prompt_len,
            computed_tokens=computed + self.spec.reference_tokens,
            reference_tokens=self.spec.reference_tokens,
            reused_tokens=max(self.prompt_len - computed, 0),
            injected_tokens=injected_total,
            view_tokens=self.view_tokens,
            corrections_accepted=sum(m == "corrected" for m in self.modes.values()),
            corrections_rejected=sum(m == "dense_fallback" for m in self.modes.values()),
            cached_tokens=self.first_prefix_len or 0,
            segments=segs,
        )
        if injected_total and not self.method.corrector:
            self.meta["inject_ms"] = round(self.inject_ms, 3)
        if self.method.lr_sharing == "rebase_lp":
            self.meta.update(rebuild_tokens=self.spec.rebuild_tokens, rebuild_wait_ms=self.spec.rebuild_wait_ms)
        if self.method.selector:
            self.meta["recomputed_token_layers"] = sum(r["recomputed_token_layers"] for r in self.recompute.values())
        if self.method.corrector:
            self.meta["correction_ms"] = round(self.correction_ms, 3)
            self.meta["recomputed_rows"] = sum(c.get("recomputed_rows", 0) for c in self.corrections.values())
            if self.kv_bytes_per_token is not None:
                self.meta["kv_bytes_per_token"] = self.kv_bytes_per_token
        if self.anchor_bytes is not None:
            self.meta["anchor_bytes"] = self.anchor_bytes
        return self.meta
