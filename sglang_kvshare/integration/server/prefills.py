"""Prefills the main process adds to an annotated request: the context-free reference caches of
the non-chained correction methods, and ReBaseShared's lazy-prefill rebuild queued after an
adapted turn (both real requests sent through SGLang's tokenizer manager into its scheduler)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import TYPE_CHECKING

from sglang.srt.managers.io_struct import GenerateReqInput
from sglang.srt.runtime_context import get_schedule

from sglang_kvshare.integration.server.annotate import special_prefix
from sglang_kvshare.methods import get_method
from sglang_kvshare.segments import WireSpec
from sglang_kvshare.segments.sources import REFERENCE_AGENT
from sglang_kvshare.segments.spec import KVShareAnnotation, Span
from sglang_kvshare.segments.wire import KEY, one_record

if TYPE_CHECKING:
    from sglang_kvshare.integration.server.host import Host

logger = logging.getLogger(__name__)


def lowest_priority() -> int:
    """The priority value SGLang's priority scheduling serves last."""
    return (1 << 63) - 1 if get_schedule().schedule_low_priority_values_first else -(1 << 63)


class PrefillMixin:
    """The prefills a method needs before a request runs (a part of ``host.Host``)."""

    async def ensure_references(self: Host, ann: KVShareAnnotation, wire: WireSpec, ids: list[int]) -> WireSpec:
        """Prefill each shared segment alone (its context-free reference cache) once per workflow.

        Non-chained correction methods start from this cache. Each prefill is a real request
        under the workflow's reference namespace; its computed tokens are charged to the request
        that needed it (``reference_tokens`` in ``meta_info.kvshare``): the spec to send.
        """
        prefix = special_prefix(self.get_tm().tokenizer)
        charged = 0
        for span in wire.spans:
            if not span.shared:
                continue
            tokens = tuple(ids[span.start : span.end])
            key = (ann.workflow, span.slot, hash(tokens))
            if key in self.referenced:
                continue
            ref = WireSpec(
                workflow=ann.workflow,
                agent=REFERENCE_AGENT,
                method="nonshared",
                spans=((Span(0, len(prefix)),) if prefix else ())
                + (Span(len(prefix), len(prefix) + len(tokens), span.slot),),
            )
            obj = GenerateReqInput(
                input_ids=list(prefix) + list(tokens),
                sampling_params={"max_new_tokens": 1, "temperature": 0, "custom_params": {KEY: ref.dumps()}},
                extra_key=ref.namespace,
            )
            out = None
            async for out in self.get_tm().generate_request(obj, None):
                pass
            meta = one_record((out or {}).get("meta_info", {}).get(KEY)) or {}
            charged += int(meta.get("computed_tokens", 0))
            self.referenced[key] = None
        return dataclasses.replace(wire, reference_tokens=charged)

    def queue_rebuild(self: Host, ann: KVShareAnnotation, ids: list[int], out: dict) -> None:
        """ReBaseShared, lazy prefill: once the adapted turn has answered (streamed or not, the
        answer does not wait), queue the adapter-free prefill of its new tokens into the
        workflow's shared namespace. The workflow's next request waits for it (``await_rebuilds``);
        other requests do not. With ``--enable-priority-scheduling`` it has the lowest priority."""
        task = asyncio.get_running_loop().create_task(self.rebuild(ann, ids, out))
        self.rebuild_tasks.add(task)
        task.add_done_callback(self.rebuild_tasks.discard)
        self.rebuilds[ann.workflow] = self.rebuilds.get(ann.workflow, []) + [task]

    async def await_rebuilds(self: Host, ann: KVShareAnnotation, wire: WireSpec) -> WireSpec:
        """Before a request of a workflow runs: wait for the rebuilds its earlier turns queued (no
        wait if they are done) and charge their tokens and the wait to it (``rebuild_tokens``,
        ``rebuild_wait_ms`` in ``meta_info.kvshare``). A failed rebuild leaves the cache to be
        prefilled by this request (logged). Returns the spec to send."""
        tasks = self.rebuilds.pop(ann.workflow, None)
        if not tasks:
            return wire
        t0 = time.perf_counter()
        done = await asyncio.gather(*tasks, return_exceptions=True)
        for d in done:
            if isinstance(d, BaseException):
                logger.warning("kvshare: rebase_shared_lp rebuild of workflow %s failed: %r", ann.workflow, d)
        return dataclasses.replace(
            wire,
            rebuild_tokens=sum(d for d in done if isinstance(d, int)),
            rebuild_wait_ms=round((time.perf_counter() - t0) * 1e3, 3),
        )

    async def prepare(self: Host, ann: KVShareAnnotation, wire: WireSpec, ids: list[int]) -> WireSpec:
        """Before an annotated request runs: the prefills its method needs (ReBaseShared LP: wait
        for the workflow's rebuilds; non-chained corrections: the reference caches); returns the
        spec to send."""
        method = get_method(ann.method)
        if method.lr_sharing == "rebase_lp":
            wire = await self.await_rebuilds(ann, wire)
        if method.needs_reference:
            wire = await self.ensure_references(ann, wire, ids)
        return wire

    async def rebuild(self: Host, ann: KVShareAnnotation, ids: list[int], out: dict) -> int:
        """The adapter-free prefill of ReBaseShared (LP); returns its computed tokens. It names
        the adapted turn (``rebuild_of``), so the scheduler puts that turn's own LR column, kept
        from its adapted hidden states, onto the rebuilt rows."""
        # the tokens the adapted path fed: its prompt and every output token but the last (never
        # an input), the span the double-batched twin of rebase_shared_db rebuilds too
        tokens = list(ids) + list(out.get("output_ids") or [])[:-1]
        wire = WireSpec(
            workflow=ann.workflow,
            agent=ann.agent,
            method=ann.method,
            spans=(Span(0, len(tokens)),),
            rebuild_of=str((out.get("meta_info") or {}).get("id") or ""),
        )
        obj = GenerateReqInput(
            input_ids=tokens,
            sampling_params={"max_new_tokens": 1, "temperature": 0, "custom_params": {KEY: wire.dumps()}},
            extra_key=wire.namespace,
            priority=lowest_priority() if self.get_tm().enable_priority_scheduling else None,
        )
        res = None
        async for res in self.get_tm().generate_request(obj, None):
            pass
        meta = one_record((res or {}).get("meta_info", {}).get(KEY)) or {}
        return int(meta.get("computed_tokens", 0))
