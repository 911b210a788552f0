"""Prefills the main process adds to an annotated request: the context-free reference caches of
the non-chained correction methods, and ReBaseShared's lazy-prefill rebuild after an adapted turn
(both real requests sent through SGLang's tokenizer manager)."""

from __future__ import annotations

import dataclasses
import json

from sglang_kvshare.integration.http_annotate import special_prefix
from sglang_kvshare.segments import WireSpec
from sglang_kvshare.segments.sources import REFERENCE_AGENT
from sglang_kvshare.segments.spec import KVShareAnnotation, Span


class PrefillMixin:
    """Needs ``args``, ``get_tm``, ``referenced`` and ``_remember``."""

    async def ensure_references(self, ann: KVShareAnnotation, payload: dict) -> None:
        """Prefill each shared segment alone (its context-free reference cache) once per workflow.

        Non-chained correction methods start from this cache. Each prefill is a real request
        under the workflow's reference namespace; its computed tokens are charged to the request
        that needed it (``reference_tokens`` in ``meta_info.kvshare``).
        """
        from sglang.srt.managers.io_struct import GenerateReqInput

        wire = WireSpec.loads(payload["sampling_params"]["custom_params"]["kvshare"])
        ids = payload["input_ids"]
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
                sampling_params={"max_new_tokens": 1, "temperature": 0, "custom_params": {"kvshare": ref.dumps()}},
                extra_key=ref.namespace,
            )
            out = None
            async for out in self.get_tm().generate_request(obj, None):
                pass
            meta = (out or {}).get("meta_info", {}).get("kvshare") or {}
            charged += int(meta.get("computed_tokens", 0))
            self.referenced[key] = None
        wire = dataclasses.replace(wire, reference_tokens=charged)
        payload["sampling_params"]["custom_params"]["kvshare"] = wire.dumps()

    def _rebuilding_send(self, send, ann: KVShareAnnotation, payload: dict):
        """ReBaseShared, lazy prefill: hold the agent's response, prefill its new tokens (prompt
        and the output tokens it fed) once more without an adapter into the workflow's shared namespace, then
        answer with ``rebuild_tokens`` (computed by that prefill) in ``meta_info.kvshare``."""
        held: dict = {"start": None, "chunks": []}
        tok = self.get_tm().tokenizer

        async def wrapped(message):
            if message["type"] == "http.response.start":
                held["start"] = message
                return
            if message["type"] != "http.response.body":
                return await send(message)
            held["chunks"].append(message.get("body", b""))
            if message.get("more_body", False):
                return
            body = b"".join(held["chunks"])
            start = held["start"]
            if start is not None and start["status"] == 200:
                self._remember(ann, body, tok)
                out = json.loads(body)
                out.setdefault("meta_info", {}).setdefault("kvshare", {})
                out["meta_info"]["kvshare"]["rebuild_tokens"] = await self.rebuild(ann, payload, out)
                body = json.dumps(out).encode()
            headers = [(k, v) for k, v in (start or {}).get("headers", []) if k.lower() != b"content-length"]
            headers.append((b"content-length", str(len(body)).encode()))
            await send(dict(start or {"type": "http.response.start", "status": 500}, headers=headers))
            await send({"type": "http.response.body", "body": body})

        return wrapped

    async def rebuild(self, ann: KVShareAnnotation, payload: dict, out: dict) -> int:
        """The adapter-free prefill of ReBaseShared (LP); returns its computed tokens."""
        from sglang.srt.managers.io_struct import GenerateReqInput

        # the tokens the adapted path fed: its prompt and every output token but the last (never
        # an input), the span the double-batched twin of rebase_shared_db rebuilds too
        tokens = list(payload["input_ids"]) + list(out.get("output_ids") or [])[:-1]
        wire = WireSpec(workflow=ann.workflow, agent=ann.agent, method=ann.method,
                        spans=(Span(0, len(tokens)),))
        obj = GenerateReqInput(
            input_ids=tokens,
            sampling_params={"max_new_tokens": 1, "temperature": 0,
                             "custom_params": {"kvshare": wire.dumps()}},
            extra_key=wire.namespace,
        )
        res = None
        async for res in self.get_tm().generate_request(obj, None):
            pass
        meta = (res or {}).get("meta_info", {}).get("kvshare") or {}
        if isinstance(meta, list):
            meta = meta[-1] if meta else {}
        return int(meta.get("computed_tokens", 0))
