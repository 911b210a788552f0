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
import time
from typing import Callable, Optional

from cachetools import FIFOCache

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
CHAT_PATH = "/v1/chat/completions"


class OutputTokens:
    """(workflow, agent) -> (output text, output token ids), least recently written forgotten."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._items: FIFOCache = FIFOCache(capacity)

    def put(self, workflow: str, agent: str, text: str, ids: list[int]) -> None:
        self._items[(workflow, agent)] = (text, ids)

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
        self.referenced: FIFOCache = FIFOCache(16 * args.max_workflows)

    async def __call__(self, scope, receive, send):
        path = scope.get("path") if scope["type"] == "http" and scope["method"] == "POST" else None
        if path not in ("/generate", CHAT_PATH):
            return await self.app(scope, receive, send)
        body = await _read_body(receive)
        try:
            payload = json.loads(body) if body else None
        except ValueError:
            payload = None
        if not isinstance(payload, dict) or "kvshare" not in payload:
            return await self.app(scope, _replay(body, receive), send)
        try:
            if path == CHAT_PATH:
                return await self.chat(scope, receive, send, payload)
            ann, payload = self.rewrite(payload)
        except AnnotationError as e:
            return await _send_json(send, 400, {"error": {"message": f"kvshare: {e}", "code": 400}})
        await self.forward_generate(scope, receive, send, ann, payload)

    async def forward_generate(self, scope, receive, send, ann: KVShareAnnotation, payload: dict) -> None:
        """Send a rewritten /generate body to SGLang, recording the agent's output tokens."""
        method = get_method(ann.method)
        if method.needs_reference:
            await self.ensure_references(ann, payload)
        new_body = json.dumps(payload).encode()
        headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(new_body)).encode()))
        scope = dict(scope, headers=headers, path="/generate", raw_path=b"/generate")
        if payload.get("stream"):
            return await self.app(scope, _replay(new_body, receive), self._streaming_send(send, ann))
        if method.lr_sharing == "rebase_lp" and payload.get("lora_path") is not None:
            return await self.app(scope, _replay(new_body, receive), self._rebuilding_send(send, ann, payload))
        return await self.app(scope, _replay(new_body, receive), self._recording_send(send, ann))

    async def chat(self, scope, receive, send, body: dict) -> None:
        """``/v1/chat/completions`` with ``kvshare`` (the OpenAI client's ``extra_body``).

        ``kvshare.shared_messages`` maps message indices to slots. The chat template is rendered,
        each shared message's content becomes a PH segment and the text around it PF segments;
        the request then runs as an annotated /generate and the answer comes back as a
        ``chat.completion`` with ``kvshare`` beside ``usage``, or with ``stream: true`` as
        ``chat.completion.chunk`` events whose last one (before ``[DONE]``) carries ``kvshare``
        (and ``usage`` when ``stream_options.include_usage``).
        """
        raw = dict(body["kvshare"]) if isinstance(body["kvshare"], dict) else body["kvshare"]
        if not isinstance(raw, dict):
            raise AnnotationError("kvshare must be an object")
        shared = raw.pop("shared_messages", {})
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise AnnotationError("messages must be a non-empty list")
        if not isinstance(shared, dict):
            raise AnnotationError("kvshare.shared_messages must map message indices to slot names")
        raw["segments"] = chat_segments(self.get_tm().tokenizer, messages, shared)
        sampling = {"max_new_tokens": body.get("max_completion_tokens") or body.get("max_tokens") or 128}
        for key in ("temperature", "top_p", "top_k", "stop", "frequency_penalty", "presence_penalty", "ignore_eos"):
            if body.get(key) is not None:
                sampling[key] = body[key]
        request = {"sampling_params": sampling, "kvshare": raw}
        if body.get("stream"):
            request["stream"] = True
        ann, payload = self.rewrite(request)
        if body.get("lora_path") is not None:
            payload["lora_path"] = body["lora_path"]
        chunk = ChatChunks(body, incremental=bool(getattr(self.get_tm(), "incremental_streaming_output", False)))
        if body.get("stream"):
            return await self.forward_generate(scope, receive, chunk.sse_send(send), ann, payload)
        captured: dict = {"status": 500, "body": b""}

        async def capture(message):
            if message["type"] == "http.response.start":
                captured["status"] = message["status"]
            elif message["type"] == "http.response.body":
                captured["body"] += message.get("body", b"")

        await self.forward_generate(scope, receive, capture, ann, payload)
        try:
            out = json.loads(captured["body"])
        except ValueError:
            out = {"error": {"message": captured["body"].decode(errors="replace")}}
        if captured["status"] != 200:
            return await _send_json(send, captured["status"], out)
        meta = out.get("meta_info", {})
        await _send_json(send, 200, {
            **chunk.head("chat.completion", meta),
            "choices": [{
                "index": 0,
                "message": {"role": "assistant", "content": out.get("text", "")},
                "finish_reason": _finish_reason(meta),
            }],
            "usage": _usage(meta),
            "kvshare": meta.get("kvshare"),
        })

    def rewrite(self, payload: dict) -> tuple[KVShareAnnotation, dict]:
        """Validate and tokenise; returns the annotation and the body to forward."""
        for key in ("text", "input_ids", "input_embeds"):
            if payload.get(key) is not None:
                raise AnnotationError(
                    f"the prompt is given by kvshare.segments; do not also send '{key}'"
                )
        ann = parse_annotation(payload["kvshare"], self.args.method)
        method = get_method(ann.method)
        lr_sharing = method.lr_sharing
        if lr_sharing and not self.args.lr_cache:
            raise AnnotationError(
                f"method {ann.method} needs a server started with --enable-lora and --kvshare-lr-cache"
            )
        if self.args.lr_cache and payload.get("lora_path") is not None and (method.corrector or method.selector):
            raise AnnotationError(
                f"method {ann.method} corrects or recomputes K/V; on a --kvshare-lr-cache server LoRA "
                "agents use nonshared, fullshared, baseshared, prelr_shared, rebase_shared_lp or rebase_shared_db"
            )
        if lr_sharing == "rebase_lp" and payload.get("stream"):
            raise AnnotationError("method rebase_shared_lp rebuilds the cache after the turn; stream is not supported")
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
            target_rho=ann.target_rho,
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

    def _streaming_send(self, send, ann: KVShareAnnotation):
        """Pass server-sent events through with ``meta_info.kvshare`` as one object, and
        remember the agent's output tokens from the last event."""
        state = {"status": 200, "pending": b"", "last": None}
        tok = self.get_tm().tokenizer

        def fix(event: bytes) -> bytes:
            if not event.startswith(b"data: ") or event.strip() == b"data: [DONE]":
                return event
            try:
                obj = json.loads(event[len(b"data: ") :])
            except ValueError:
                return event
            meta = obj.get("meta_info") if isinstance(obj, dict) else None
            if isinstance(meta, dict) and isinstance(meta.get("kvshare"), list):
                meta["kvshare"] = meta["kvshare"][-1] if meta["kvshare"] else None
            state["last"] = obj
            return b"data: " + json.dumps(obj).encode()

        async def wrapped(message):
            if message["type"] == "http.response.start":
                state["status"] = message["status"]
                message = dict(message, headers=[(k, v) for k, v in message.get("headers", [])
                                                 if k.lower() != b"content-length"])
            elif message["type"] == "http.response.body" and state["status"] == 200:
                data = state["pending"] + message.get("body", b"")
                more = message.get("more_body", False)
                events = data.split(b"\n\n")
                state["pending"] = events.pop() if more else b""
                body = b"".join(fix(e) + b"\n\n" for e in events if e)
                if not more:
                    if state["last"] is not None:
                        self._remember(ann, state["last"], tok)
                message = dict(message, body=body)
            await send(message)

        return wrapped

    def _remember(self, ann: KVShareAnnotation, body, tok) -> None:
        """Keep the agent's output token ids (``body``: a response JSON, bytes or parsed)."""
        try:
            out = json.loads(body) if isinstance(body, (bytes, str)) else body
        except ValueError:
            return
        if not isinstance(out, dict) or "output_ids" not in out:
            return
        ids = exact_output_ids(tok, out["output_ids"], out.get("text", ""))
        if ids:
            self.outputs.put(ann.workflow, ann.agent, out.get("text", ""), ids)


def _finish_reason(meta: dict) -> Optional[str]:
    finish = meta.get("finish_reason")
    if not finish:
        return None
    return "length" if finish.get("type") == "length" else "stop"


def _usage(meta: dict) -> dict:
    usage = {"prompt_tokens": meta.get("prompt_tokens", 0), "completion_tokens": meta.get("completion_tokens", 0)}
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    return usage


class ChatChunks:
    """An annotated chat request's answer in OpenAI's chat-completion shapes."""

    def __init__(self, body: dict, incremental: bool):
        self.model = body.get("model", "")
        self.created = int(time.time())
        opts = body.get("stream_options")
        self.include_usage = isinstance(opts, dict) and bool(opts.get("include_usage"))
        self.incremental = incremental  # SGLang streams deltas, not the text so far

    def head(self, obj: str, meta: dict) -> dict:
        return {"id": meta.get("id", ""), "object": obj, "created": self.created, "model": self.model}

    def sse_send(self, send):
        """Turn /generate's server-sent events (through ``_streaming_send``) into
        ``chat.completion.chunk`` events; the last chunk carries ``kvshare`` (and ``usage``)."""
        state = {"status": 200, "pending": b"", "text": "", "role": False, "meta": None}

        def event(obj: dict) -> bytes:
            return b"data: " + json.dumps(obj).encode() + b"\n\n"

        def convert(raw: bytes) -> bytes:
            if not raw.startswith(b"data: "):
                return b""
            if raw.strip() == b"data: [DONE]":
                meta = state["meta"] or {}
                last = {**self.head("chat.completion.chunk", meta), "choices": [], "kvshare": meta.get("kvshare")}
                if self.include_usage:
                    last["usage"] = _usage(meta)
                return event(last) + b"data: [DONE]\n\n"
            try:
                obj = json.loads(raw[len(b"data: "):])
            except ValueError:
                return b""
            if not isinstance(obj, dict) or "error" in obj:
                return raw + b"\n\n"  # SGLang's error event, as it is
            meta = obj.get("meta_info") or {}
            state["meta"] = meta
            text = obj.get("text") or ""
            if self.incremental:
                delta = text
            else:
                delta, state["text"] = text[len(state["text"]):], text
            choice_delta = {"content": delta}
            if not state["role"]:
                choice_delta = {"role": "assistant", **choice_delta}
                state["role"] = True
            finish = _finish_reason(meta)
            if not delta and finish is None and "role" not in choice_delta:
                return b""
            choice = {"index": 0, "delta": choice_delta, "finish_reason": finish}
            return event({**self.head("chat.completion.chunk", meta), "choices": [choice]})

        async def wrapped(message):
            if message["type"] == "http.response.start":
                state["status"] = message["status"]
            elif message["type"] == "http.response.body" and state["status"] == 200:
                data = state["pending"] + message.get("body", b"")
                more = message.get("more_body", False)
                events = data.split(b"\n\n")
                state["pending"] = events.pop() if more else b""
                message = dict(message, body=b"".join(convert(e) for e in events if e))
            await send(message)

        return wrapped


def exact_output_ids(tok, output_ids, text: str) -> Optional[list[int]]:
    """The output tokens that stand for ``text`` when a later prompt quotes it: trailing special
    tokens dropped; None unless they decode to exactly ``text``."""
    ids = list(output_ids)
    special = set(getattr(tok, "all_special_ids", []) or [])
    while ids and ids[-1] in special:
        ids.pop()
    return ids if ids and tok.decode(ids) == text else None


def chat_segments(tok, messages: list, shared: dict) -> list[dict]:
    """Segments of the rendered chat prompt: each shared message's content is a PH segment."""
    try:
        slots = {int(k): v for k, v in shared.items()}
    except (TypeError, ValueError):
        raise AnnotationError("kvshare.shared_messages keys must be message indices") from None
    for i, slot in slots.items():
        if not 0 <= i < len(messages):
            raise AnnotationError(f"kvshare.shared_messages names message {i}; there are {len(messages)}")
        if not isinstance(messages[i], dict) or not isinstance(messages[i].get("content"), str):
            raise AnnotationError(f"message {i} must have string content to be shared")
        if not isinstance(slot, str) or not slot:
            raise AnnotationError(f"kvshare.shared_messages[{i}] must be a slot name")
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prefix = tok.decode(_special_prefix(tok))
    if prefix and text.startswith(prefix):
        text = text[len(prefix) :]  # the tokenizer adds it again
    segments, cursor = [], 0
    for i in sorted(slots):
        content = messages[i]["content"]
        at = text.find(content, cursor)
        if at < 0 or not content:
            raise AnnotationError(f"message {i}'s content does not appear in the rendered chat prompt")
        if at > cursor:
            segments.append({"text": text[cursor:at], "shared": False})
        segments.append({"text": content, "shared": True, "slot": slots[i]})
        cursor = at + len(content)
    if cursor < len(text):
        segments.append({"text": text[cursor:], "shared": False})
    return segments


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
