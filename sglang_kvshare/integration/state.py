"""Scheduler-process state of the plugin: config, source registry, per-request segment state.

Only the scheduler process mutates this; SGLang runs its scheduling loop on one thread.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from typing import Any, Optional

from cachetools import FIFOCache

from sglang_kvshare.config import KVShareArgs
from sglang_kvshare.methods import MethodSpec, get_method
from sglang_kvshare.segments import Span, WireSpec
from sglang_kvshare.segments.sources import REFERENCE_AGENT, SourceRecord, SourceRegistry, common_prefix

logger = logging.getLogger(__name__)

CUSTOM_PARAM_KEY = "kvshare"
META_KEY = "kvshare"


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
    computed_tokens: int = 0
    meta: dict[str, Any] = field(default_factory=dict)

    def source(self, registry: SourceRegistry, slot: str) -> Optional[SourceRecord]:
        """The cache to start from for ``slot``: the named or most recent agent's, or, for
        methods that correct a context-free reference, the reference when no agent has one."""
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

    def next_cut(self, registry: SourceRegistry, after: int) -> Optional[int]:
        """First position > ``after`` where a PH span to inject starts."""
        starts = [s.start for _, s in self.injectable_starts(registry) if s.start > after]
        return min(starts) if starts else None

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
                        recomputed_token_layers=job.token_layers,
                        layer_groups=[list(g) for g in job.layer_groups],
                    )
                entry.update(self.recompute[i])
            segs.append(entry)
        self.meta.update(
            method=self.method.name,
            workflow=self.spec.workflow,
            agent=self.spec.agent,
            prompt_tokens=self.prompt_len,
            computed_tokens=self.computed_tokens + self.spec.reference_tokens,
            reference_tokens=self.spec.reference_tokens,
            reused_tokens=max(self.prompt_len - self.computed_tokens, 0),
            injected_tokens=injected_total,
            corrections_accepted=sum(m == "corrected" for m in self.modes.values()),
            corrections_rejected=sum(m == "dense_fallback" for m in self.modes.values()),
            cached_tokens=self.first_prefix_len or 0,
            segments=segs,
        )
        if self.method.selector:
            self.meta["recomputed_token_layers"] = sum(
                r["recomputed_token_layers"] for r in self.recompute.values()
            )
        if self.method.corrector:
            self.meta["correction_ms"] = round(self.correction_ms, 3)
            if self.kv_bytes_per_token is not None:
                self.meta["kv_bytes_per_token"] = self.kv_bytes_per_token
        if self.anchor_bytes is not None:
            self.meta["anchor_bytes"] = self.anchor_bytes
        return self.meta


class PluginContext:
    """Process-wide plugin state of a scheduler process."""

    def __init__(self, args: KVShareArgs):
        self.args = args
        self.registry = SourceRegistry(args.max_workflows)
        self.requests: dict[str, ReqShareState] = {}
        self._correctors: dict[str, Any] = {}
        self._controllers: dict[tuple[str, Optional[float]], Any] = {}
        self._budget: Optional[int] = None
        from sglang_kvshare.integration.observer import Observer

        self.observer = Observer(args.observe)
        from sglang_kvshare.integration.anchor_file import AnchorPoolFile

        self.anchor_file = AnchorPoolFile(self)
        self.rng = random.Random(0)  # shadow sampling
        self.rope = None  # the model's RopeSpec, set at the first injection
        # baseshared: (workflow, agent) -> token ids the agent has processed itself
        self.processed: FIFOCache = FIFOCache(16 * args.max_workflows)

    def remember_processed(self, workflow: str, agent: str, tokens: tuple[int, ...]) -> None:
        self.processed[(workflow, agent)] = tokens

    def processed_prefix(self, workflow: str, agent: str, tokens) -> int:
        """Length of the common prefix of ``tokens`` and what ``agent`` processed before."""
        return common_prefix(self.processed.get((workflow, agent), ()), tokens)

    def corrector(self, name: str):
        """The process-wide corrector of method ``name`` (one set of pools per method)."""
        if name not in self._correctors:
            import torch

            from sglang_kvshare.correction import create_corrector

            overrides: dict[str, Any] = {}
            if name.startswith("kvcmas"):
                overrides = {"num_anchors": self.args.num_anchors, "tau": self.args.tau,
                             "factor_dtype": getattr(torch, self.args.anchor_dtype)}
                if name != "kvcmas_plus":  # its ranks are energy-chosen under caps of its own
                    overrides.update(rank_base=self.args.rank, rank_delta=self.args.rank)
            elif name == "kvcomm":
                overrides = {"tau": self.args.tau}
            self._correctors[name] = create_corrector(name, **overrides)
        return self._correctors[name]

    def tau_controller(self, name: str, target_rho: Optional[float] = None):
        """The gate threshold controller of method ``name`` for a reuse target (None: the
        server's ``--kvshare-target-rho``, or a fixed tau when that is -1)."""
        from sglang_kvshare.correction.tuning import TauController

        if target_rho is None and self.args.target_rho > 0:
            target_rho = self.args.target_rho
        key = (name, target_rho)
        if key not in self._controllers:
            max_error = self.args.max_error if self.args.shadow_fraction > 0 else None
            self._controllers[key] = TauController(
                getattr(self.corrector(name).config, "tau", 1.0), target_rho=target_rho, max_error=max_error
            )
        return self._controllers[key]

    def anchor_bytes_total(self) -> int:
        return sum(c.nbytes() for c in self._correctors.values())

    def anchor_budget(self) -> int:
        """Bytes all correction state may hold: ``--kvshare-anchor-budget-mb``, or (when -1)
        ``--kvshare-anchor-mem-fraction`` of the memory free when first asked (after SGLang
        sized its KV pool): the accelerator's when the model runs on one, else the host's."""
        if self._budget is None:
            if self.args.anchor_budget_mb >= 0:
                self._budget = int(self.args.anchor_budget_mb * 2**20)
            else:
                import torch

                if torch.cuda.is_available():
                    free = torch.cuda.mem_get_info()[0]
                else:
                    import psutil

                    free = psutil.virtual_memory().available
                self._budget = int(self.args.anchor_mem_fraction * free)
                logger.info("kvshare: anchor budget %.0f MiB (%.0f%% of %.0f MiB free)",
                            self._budget / 2**20, 100 * self.args.anchor_mem_fraction, free / 2**20)
        return self._budget

    def enforce_anchor_budget(self, keep=()) -> int:
        """Evict anchors (LFU among the 5 oldest of all pools, never those in ``keep``) until all
        correction state fits ``anchor_budget()``; returns how many were evicted."""
        from sglang_kvshare.correction.pool import evict_lfu_oldest

        pools = [c for c in self._correctors.values() if hasattr(c, "anchors")]
        fixed = sum(c.nbytes() for c in self._correctors.values() if not hasattr(c, "anchors"))
        return evict_lfu_oldest(pools, self.anchor_budget() - fixed, keep=keep)

    def anchor_version(self) -> int:
        """Changes whenever an anchor is inserted, merged or evicted."""
        total = 0
        for c in self._correctors.values():
            st = c.stats()
            total += st.get("num_inserted", 0) + st.get("num_merged", 0) + st.get("num_evicted", 0)
        return total

    def stats(self) -> dict[str, Any]:
        """Plain-value state of the sharing machinery (``/server_info`` internal state)."""
        return {
            "anchor_bytes": self.anchor_bytes_total(),
            "anchor_budget_bytes": self._budget,
            "pending_observations": self.observer.pending,
            "observations_done": self.observer.num_done,
            "observations_failed": self.observer.num_failed,
            "correctors": {name: c.stats() for name, c in self._correctors.items()},
            "tau_controllers": {f"{n}@{t}": c.stats() for (n, t), c in self._controllers.items()},
            "anchor_pool_saves": self.anchor_file.num_saves,
        }

    def lookup(self, req) -> Optional[ReqShareState]:
        """The segment state of a scheduler ``Req`` (None: unannotated, or not admitted)."""
        return self.requests.get(req.rid)

    def admit(self, req) -> Optional[ReqShareState]:
        """Create the segment state of an annotated ``Req`` entering the scheduler's queue (once;
        a retracted request re-entering keeps its state) and let its method family adjust the
        request (``sharing.Family.admit``); None if unannotated."""
        st = self.requests.get(req.rid)
        if st is not None:
            return st
        params = getattr(req.sampling_params, "custom_params", None)
        if not isinstance(params, dict) or CUSTOM_PARAM_KEY not in params:
            return None
        from sglang_kvshare.integration.sharing import family_of

        spec = WireSpec.loads(params[CUSTOM_PARAM_KEY])
        st = ReqShareState(spec=spec, method=get_method(spec.method), prompt_len=len(req.origin_input_ids))
        self.requests[req.rid] = st
        family_of(st.method).admit(self, req, st)
        req.customized_info = {META_KEY: [st.refresh_meta()]}
        return st

    def forget(self, req) -> Optional[ReqShareState]:
        return self.requests.pop(req.rid, None)


_CONTEXT: Optional[PluginContext] = None


def context() -> PluginContext:
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = PluginContext(KVShareArgs.from_env())
    return _CONTEXT
