"""OpenAI chat adapter of annotated requests (HTTP process): ``/v1/chat/completions`` with
``kvshare`` becomes an annotated /generate; its answer comes back as a ``chat.completion`` or as
``chat.completion.chunk`` events."""

from __future__ import annotations

import json
import time
from typing import Optional

from sglang_kvshare.integration.server.annotate import special_prefix
from sglang_kvshare.integration.server.asgi import ok_body_send, send_json, split_events
from sglang_kvshare.segments import AnnotationError
from sglang_kvshare.segments.wire import KEY


class ChatMixin:
    """Needs ``get_tm``, ``rewrite`` and ``forward_generate``."""

    async def chat(self, scope, receive, send, body: dict) -> None:
        """``/v1/chat/completions`` with ``kvshare`` (the OpenAI client's ``extra_body``).

        ``kvshare.shared_messages`` maps message indices to slots. The chat template is rendered,
        each shared message's content becomes a PH segment and the text around it PF segments;
        the request then runs as an annotated /generate and the answer comes back as a
        ``chat.completion`` with ``kvshare`` beside ``usage``, or with ``stream: true`` as
        ``chat.completion.chunk`` events whose last one (before ``[DONE]``) carries ``kvshare``
        (and ``usage`` when ``stream_options.include_usage``).
        """
        raw = dict(body[KEY]) if isinstance(body[KEY], dict) else body[KEY]
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
        request = {"sampling_params": sampling, KEY: raw}
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
            return await send_json(send, captured["status"], out)
        meta = out.get("meta_info", {})
        await send_json(send, 200, {
            **chunk.head("chat.completion", meta),
            "choices": [{
                "index": 0,
                "message": {"role": "assistant", "content": out.get("text", "")},
                "finish_reason": _finish_reason(meta),
            }],
            "usage": _usage(meta),
            KEY: meta.get(KEY),
        })


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
        state = {"pending": b"", "text": "", "role": False, "meta": None}

        def event(obj: dict) -> bytes:
            return b"data: " + json.dumps(obj).encode() + b"\n\n"

        def convert(raw: bytes) -> bytes:
            if not raw.startswith(b"data: "):
                return b""
            if raw.strip() == b"data: [DONE]":
                meta = state["meta"] or {}
                last = {**self.head("chat.completion.chunk", meta), "choices": [], KEY: meta.get(KEY)}
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

        def rewrite(message):
            events, _ = split_events(state, message)
            return dict(message, body=b"".join(convert(e) for e in events))

        return ok_body_send(send, rewrite)


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
    prefix = tok.decode(special_prefix(tok))
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
