"""The sharing contract: what each method family does at the three points the scheduler hooks
call, behind one interface.

- ``admit(ses, req, st)``: once, when an annotated request enters the scheduler's queue;
- ``share(ses, scheduler, req, st, index, span, rec, n, rope)``: between two prefill chunks, for
  the shared segment whose sharing starts at the request's prefix (its start, or past the head
  rows ``st.heads[index]`` the chunk before computed) and has source ``rec`` covering ``n``
  tokens; returns the ``InjectResult`` of the rows from there to commit as prefix, or None (the
  segment enters the next extend: computed, or recomputed in part);
- ``release(ses, tree, req, st, owned)``: when a finished request's KV (``owned`` tokens) is in
  the tree, before its slots become sources.

Families: ``inject`` (fullshared), ``correct`` (KVCMAS and the correction baselines),
``recompute`` (CacheBlend, DroidSpeak, RelayCaching), ``lr`` (PReCache), ``none`` (nonshared).
Every family reads a source cache through ``cache.kv_io.read_source``.
"""

from __future__ import annotations

import time
from typing import Optional

from sglang_kvshare.integration.cache.kv_io import commit_injection
from sglang_kvshare.integration.scheduler.correct import correct_segment, observe_fallbacks
from sglang_kvshare.integration.scheduler.inject import inject_segment, injectable_len
from sglang_kvshare.integration.scheduler.recompute_jobs import plan_segment
from sglang_kvshare.methods import MethodSpec


class Family:
    """Default: nothing to do at any point (``nonshared``)."""

    name = "none"

    def admit(self, ses, req, st) -> None:
        pass

    def share(self, ses, scheduler, req, st, index, span, rec, n, rope):
        return None

    def release(self, ses, tree, req, st, owned: int) -> None:
        pass


class Inject(Family):
    name = "inject"

    def share(self, ses, scheduler, req, st, index, span, rec, n, rope):
        return inject_segment(ses, scheduler, req, span, rec, n, rope)


class Correct(Family):
    name = "correct"

    def admit(self, ses, req, st) -> None:
        st.head_window = ses.recompute_head(st.spec, st.method)

    def share(self, ses, scheduler, req, st, index, span, rec, n, rope):
        corrector = ses.corrector(st.method.corrector)
        t0 = time.perf_counter()
        result = correct_segment(ses, scheduler, req, st, index, span, rec, n, rope, corrector)
        st.correction_ms += 1000.0 * (time.perf_counter() - t0)  # rejections' gather and gate too
        st.anchor_bytes = corrector.nbytes()
        return result

    def release(self, ses, tree, req, st, owned: int) -> None:
        if st.pending:
            observe_fallbacks(ses, tree, req, st, ses.rope, owned)


class Recompute(Family):
    name = "recompute"

    def share(self, ses, scheduler, req, st, index, span, rec, n, rope):
        return plan_segment(ses, scheduler, req, st, index, span, rec, n, rope)


class LR(Family):
    """PReCache: one radix namespace of base K/V for all adapters of a workflow."""

    name = "lr"

    def admit(self, ses, req, st) -> None:
        if req.lora_id and req.extra_key.endswith(req.lora_id):
            # one tree for all adapters: SGLang appended the adapter id to the namespace
            req.extra_key = req.extra_key[: -len(req.lora_id)]
        if st.method.lr_sharing in ("rebase_lp", "rebase_db") and req.lora_id:
            # its base KV comes from adapted hidden states: the adapter-free rebuild caches the
            # turn (with this request's own LR column, ``own_column.py``)
            req.skip_radix_cache_insert = True

    def release(self, ses, tree, req, st, owned: int) -> None:
        if st.method.lr_sharing == "baseshared" and req.lora_id is not None:
            tokens = tuple(req.full_untruncated_fill_ids[:owned])
            ses.remember_processed(st.spec.workflow, st.spec.agent, tokens)


FAMILIES = {f.name: f for f in (Family(), Inject(), Correct(), Recompute(), LR())}


def family_of(method: MethodSpec) -> Family:
    if method.lr_sharing:
        return FAMILIES["lr"]
    if method.selector:
        return FAMILIES["recompute"]
    if method.corrector:
        return FAMILIES["correct"]
    return FAMILIES["inject" if method.injects else "none"]


def share_pending(ses, scheduler, req, st, rope) -> Optional[int]:
    """Share the segment of ``req`` whose sharing starts at its prefix (``share_at``: its start,
    or past its head rows; the one call site of ``share``); returns its span index, or None when
    no shared segment with a source starts there."""
    for i, span in st.injectable_starts(ses.registry):
        at = st.share_at(ses.registry, i, span, req.origin_input_ids)
        if at != req.prefix_len:
            continue
        st.decided.add(i)
        rec = st.source(ses.registry, span.slot)
        n = 0 if rec is None else injectable_len(req, span, rec)
        head = at - span.start
        result = family_of(st.method).share(ses, scheduler, req, st, i, span, rec, n, rope) if n > head else None
        if head and n and n <= head:  # the source's rows all lie in the head: computed
            st.corrections[i] = {"recomputed_head": head}
        if rec is not None:
            st.sources[i] = rec.agent  # the record names it even when the segment was computed
        if result is None:
            st.modes.setdefault(i, "dense_fallback" if i in st.pending else "computed")
        else:
            commit_injection(scheduler, req, at, result.dst)
            st.modes[i] = "corrected" if st.method.corrector else "injected"
            st.injected[i] = result.num_tokens
            st.sources[i] = result.source_agent
        st.refresh_meta()
        return i
    return None
