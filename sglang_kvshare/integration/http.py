"""Main-process HTTP layer: turns a ``kvshare`` annotation on ``/generate`` into token ids.

An ASGI middleware on SGLang's own FastAPI app. For a ``POST /generate`` whose JSON body has a
``kvshare`` object it validates the annotation (HTTP 400 naming the defect), tokenises each
segment on its own, and forwards the request to SGLang as ``input_ids`` with the segment spec in
``sampling_params.custom_params`` and the agent's radix namespace in ``extra_key``. Responses of
annotated requests are read to remember each agent's output token ids, so a later agent's
``out:<agent>`` segment uses exactly the tokens whose KV the source holds.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections import OrderedDict
from typing import Callable, Optional

from sglang_kvshare.config import KVShareArgs
from sglang_kvshare.segments import (
    AnnotationError,
    WireSpec,
    parse_annotation,
    tokenize_segments,
)
from sglang_kvshare.methods import get_method
from sglang_kvshare.segments.sources import REFERENCE_AGENT
from sglang_kvshare.segments.spec import KVShareAnnotation, Span

logger = logging.getLogger(__name__)

OUTPUT_PREFIX = "out:"


class OutputTokens:
    """(workflow, agent) -> (output text, output token ids), least recently used forgotten."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._items: "OrderedDict[tuple[str, str], tuple[str, list[int]]]" = OrderedDict()

    def put(self, workflow: str, agent: str, text: str, ids: list[int]) -> None:
        self._items[(workflow, agent)] = (text, ids)
        self._items.move_to_end((workflow, agent))
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, workflow: str, agent: str, text: str) -> Optional[list[int]]:
        item = self._items.get((workflow, agent))
        if item is None or item[0] != text:
            return None
        return list(item[1])


class KVShareMiddleware:
    def __init__(self, app, args: KVShareArgs, get_tokenizer_manager: Callable):
        self.app = app
        self.args = args
        self.get_tm = get_tokenizer_manager
        self.outputs = OutputTokens(capacity=16 * args.max_workflows)
        self.referenced: "OrderedDict[tuple, None]" = OrderedDict()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] != "/generate":
            return await self.app(scope, receive, send)
        body = await _read_body(receive)
        try:
            payload = json.loads(body) if body else None
        except ValueError:
            payload = None
        if not isinstance(payload, dict) or "kvshare" not in payload:
            return await self.app(scope, _replay(body, receive), send)
        try:
            ann, payload = self.rewrite(payload)
        except AnnotationError as e:
            return await _send_json(send, 400, {"error": {"message": f"kvshare: {e}", "code": 400}})
        if get_method(ann.method).needs_reference:
            await self.ensure_references(ann, payload)
        new_body = json.dumps(payload).encode()
        headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(new_body)).encode()))
        scope = dict(scope, headers=headers)
        if payload.get("stream"):
            return await self.app(scope, _replay(new_body, receive), send)
        return await self.app(scope, _replay(new_body, receive), self._recording_send(send, ann))

    def rewrite(self, payload: dict) -> tuple[KVShareAnnotation, dict]:
        """Validate and tokenise; returns the annotation and the body to forward."""
        for key in ("text", "input_ids", "input_embeds"):
            if payload.get(key) is not None:
                raise AnnotationError(
                    f"the prompt is given by kvshare.segments; do not also send '{key}'"
                )
        ann = parse_annotation(payload["kvshare"], self.args.method)
        tm = self.get_tm()
        tok = tm.tokenizer
        prefix = _special_prefix(tok)

        def slot_tokens(slot: str, text: str):
            if not slot.startswith(OUTPUT_PREFIX):
                return None
            return self.outputs.get(ann.workflow, slot[len(OUTPUT_PREFIX) :], text)

        prompt = tokenize_segments(
            ann.segments, lambda t: tok.encode(t, add_special_tokens=False), prefix, slot_tokens
        )
        if len(prompt.input_ids) >= tm.context_len:
            raise AnnotationError(
                f"the prompt has {len(prompt.input_ids)} tokens; the model's context is "
                f"{tm.context_len} tokens"
            )
        wire = WireSpec(
            workflow=ann.workflow,
            agent=ann.agent,
            method=ann.method,
            spans=tuple(prompt.spans),
            sources=ann.sources,
            recompute_ratio=ann.recompute_ratio,
            tau=ann.tau,
        )
        out = {k: v for k, v in payload.items() if k != "kvshare"}
        out["input_ids"] = prompt.input_ids
        sp = dict(out.get("sampling_params") or {})
        sp["custom_params"] = {**(sp.get("custom_params") or {}), "kvshare": wire.dumps()}
        out["sampling_params"] = sp
        out["extra_key"] = wire.namespace
        return ann, out

    async def ensure_references(self, ann: KVShareAnnotation, payload: dict) -> None:
        """Prefill each shared segment alone (its context-free reference cache) once per workflow.

        Non-chained correction methods start from this cache. Each prefill is a real request
        under the workflow's reference namespace; its computed tokens are charged to the request
        that needed it (``reference_tokens`` in ``meta_info.kvshare``).
        """
        from sglang.srt.managers.io_struct import GenerateReqInput

        wire = WireSpec.loads(payload["sampling_params"]["custom_params"]["kvshare"])
        ids = payload["input_ids"]
        prefix = _special_prefix(self.get_tm().tokenizer)
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
            while len(self.referenced) > 16 * self.args.max_workflows:
                self.referenced.popitem(last=False)
        wire = dataclasses.replace(wire, reference_tokens=charged)
        payload["sampling_params"]["custom_params"]["kvshare"] = wire.dumps()

    def _recording_send(self, send, ann: KVShareAnnotation):
        chunks: list[bytes] = []
        state = {"status": 200}
        tok = self.get_tm().tokenizer

        async def wrapped(message):
            if message["type"] == "http.response.start":
                state["status"] = message["status"]
            elif message["type"] == "http.response.body" and state["status"] == 200:
                chunks.append(message.get("body", b""))
                if not message.get("more_body", False):
                    self._remember(ann, b"".join(chunks), tok)
            await send(message)

        return wrapped

    def _remember(self, ann: KVShareAnnotation, body: bytes, tok) -> None:
        try:
            out = json.loads(body)
        except ValueError:
            return
        if not isinstance(out, dict) or "output_ids" not in out:
            return
        ids = list(out["output_ids"])
        special = set(getattr(tok, "all_special_ids", []) or [])
        while ids and ids[-1] in special:
            ids.pop()
        text = out.get("text", "")
        # NOTE: only tokens that decode to exactly the returned text may stand in for it.
        if ids and tok.decode(ids) == text:
            self.outputs.put(ann.workflow, ann.agent, text, ids)


def _special_prefix(tok) -> list[int]:
    """Token ids the tokenizer puts before any prompt (e.g. BOS), found by encoding a probe."""
    probe = "a"
    with_special = tok.encode(probe, add_special_tokens=True)
    without = tok.encode(probe, add_special_tokens=False)
    if len(with_special) > len(without) and with_special[-len(without) :] == without:
        return with_special[: len(with_special) - len(without)]
    return []


async def _read_body(receive) -> bytes:
    parts = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        parts.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(parts)


def _replay(body: bytes, receive):
    """A receive channel that yields ``body`` once, then the client's own messages."""
    sent = False

    async def replayed():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


async def _send_json(send, status: int, obj: dict) -> None:
    data = json.dumps(obj).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": data})


def install(app, args: KVShareArgs) -> None:
    """Add the middleware to SGLang's FastAPI ``app`` (before the server starts)."""
    from sglang.srt.entrypoints.http_server import get_global_state

    app.add_middleware(
        KVShareMiddleware, args=args, get_tokenizer_manager=lambda: get_global_state().tokenizer_manager
    )
