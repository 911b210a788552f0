"""Annotated chat requests (HTTP process): ``/v1/chat/completions`` with ``kvshare`` runs through
SGLang's own OpenAI chat serving, so its template, tools, ``response_format``, ``logprobs``,
``n``, ``seed``, stop, streaming, usage and tool-call / reasoning parsers work the same with and
without sharing.

The middleware (:meth:`ChatMixin.chat`) checks the annotation (``kvshare.shared_messages`` maps
message indices to slots; HTTP 400 naming a defect), takes it out of the body and hands SGLang
the request with a :class:`ChatShare` in its ASGI scope. The hooks of ``chat_serving.py`` then
supply, from SGLang's rendered prompt, the segment-wise token ids and the sharing spec. The answer
carries the request's ``kvshare`` record: beside ``usage`` in a ``chat.completion``; streamed, as
a last ``chat.completion.chunk`` (no choices) before ``[DONE]``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from sglang_kvshare.integration.server.annotate import special_prefix
from sglang_kvshare.integration.server.asgi import ok_body_send, replay, split_events, with_json_added, with_length
from sglang_kvshare.integration.server.share import RequestShare, in_scope
from sglang_kvshare.segments import AnnotationError, parse_annotation
from sglang_kvshare.segments.detect import message_starts
from sglang_kvshare.segments.wire import KEY, output_agent

if TYPE_CHECKING:
    from sglang_kvshare.integration.server.host import Host


@dataclass(frozen=True)
class Piece:
    """A shared message of an annotated chat request: its ``text`` is message ``message``'s."""

    slot: str
    text: str
    message: int


@dataclass
class ChatShare(RequestShare):
    """A chat request to share: its annotation is complete once SGLang rendered the prompt."""

    raw: dict = field(default_factory=dict)  # the ``kvshare`` object without ``shared_messages``
    pieces: list[Piece] = field(default_factory=list)  # shared texts, in prompt order
    contents: list[str] = field(default_factory=list)  # auto: the messages' text contents

    def annotate(self, prompt: str, tok, stock_ids: list[int]) -> list[int]:
        """The segments of SGLang's rendered ``prompt`` (each piece a PH segment), parsed and
        tokenised; returns the token ids. Detected pieces (``auto``) are cut from SGLang's own
        token ids ``stock_ids`` instead (``AutoMixin.detected``)."""
        if self.auto is not None:
            starts = message_starts(prompt, self.contents)
            self.ann, self.wire = self.owner.detected(self.raw, self.auto, prompt, stock_ids, starts)
            self.input_ids = list(stock_ids)
            return self.input_ids
        self.ann = parse_annotation(
            {**self.raw, "segments": chat_segments(prompt, tok, self.pieces)}, self.owner.args.method
        )
        self.input_ids, self.wire = self.owner.tokenize(self.ann)
        return self.input_ids


class ChatMixin:
    """Annotated chat requests, run by SGLang's own chat serving (a part of ``host.Host``)."""

    async def chat(self: Host, scope, receive, send, body: dict) -> None:
        """``/v1/chat/completions`` with ``kvshare`` (the OpenAI client's ``extra_body``)."""
        raw = body[KEY]
        if not isinstance(raw, dict):
            raise AnnotationError("kvshare must be an object")
        raw = dict(raw)
        pieces = shared_contents(body.get("messages"), raw.pop("shared_messages", {}))
        # every other field is checked now, before SGLang sees the request
        probe = [{"text": p.text, "shared": True, "slot": p.slot} for p in pieces]
        ann = parse_annotation({**raw, "segments": probe + [{"text": ".", "shared": False}]}, self.args.method)
        self.check_method(ann, body.get("lora_path"))
        share = ChatShare(self, raw=raw, pieces=pieces)
        share.sources_missing = self.note_sources(ann.workflow, any(output_agent(p.slot) for p in pieces))
        await self.hand_on(scope, receive, send, {k: v for k, v in body.items() if k != KEY}, share)

    async def hand_on(self: Host, scope, receive, send, body: dict, share: ChatShare) -> None:
        """SGLang's chat serving runs ``body`` with ``share`` in the request's scope; the answer
        gets the request's record."""
        new_body = json.dumps(body).encode()
        scope = in_scope(dict(scope, headers=with_length(scope["headers"], len(new_body))), share)
        if body.get("stream"):
            send = _stream_record_send(send, share)
        else:
            send = with_json_added(send, KEY, lambda: share.with_notes(share.record or {}))
        await self.app(scope, replay(new_body, receive), send)


def shared_contents(messages: Any, shared: Any) -> list[Piece]:
    """``kvshare.shared_messages`` checked against ``messages``: the shared contents in order."""
    if not isinstance(messages, list) or not messages:
        raise AnnotationError("messages must be a non-empty list")
    if not isinstance(shared, dict):
        raise AnnotationError("kvshare.shared_messages must map message indices to slot names")
    try:
        slots = {int(k): v for k, v in shared.items()}
    except (TypeError, ValueError):
        raise AnnotationError("kvshare.shared_messages keys must be message indices") from None
    out = []
    for i, slot in sorted(slots.items()):
        if not 0 <= i < len(messages):
            raise AnnotationError(f"kvshare.shared_messages names message {i}; there are {len(messages)}")
        content = messages[i].get("content") if isinstance(messages[i], dict) else None
        if not isinstance(content, str) or not content:
            raise AnnotationError(f"message {i} must have non-empty string content to be shared")
        if not isinstance(slot, str) or not slot:
            raise AnnotationError(f"kvshare.shared_messages[{i}] must be a slot name")
        out.append(Piece(slot, content, i))
    return out


def chat_segments(prompt: str, tok, pieces: list[Piece]) -> list[dict]:
    """Segments of a rendered chat ``prompt``: each piece's text (in order) a PH segment, the
    text around them PF segments."""
    prefix = tok.decode(special_prefix(tok))
    if prefix and prompt.startswith(prefix):
        prompt = prompt[len(prefix) :]  # the tokenizer adds it again
    segments, cursor = [], 0
    for piece in pieces:
        at = prompt.find(piece.text, cursor)
        if at < 0:
            raise AnnotationError(f"message {piece.message}'s content does not appear in the rendered chat prompt")
        if at > cursor:
            segments.append({"text": prompt[cursor:at], "shared": False})
        segments.append({"text": piece.text, "shared": True, "slot": piece.slot})
        cursor = at + len(piece.text)
    if cursor < len(prompt):
        segments.append({"text": prompt[cursor:], "shared": False})
    return segments


def _stream_record_send(send, share: ChatShare):
    """Server-sent chunks passed on, ``kvshare`` added to the last one before ``[DONE]`` when it
    has no choices (the usage chunk), else in one more ``chat.completion.chunk`` without choices.
    Each chunk is held until the next one arrives."""
    state: dict = {"pending": b"", "held": None}

    def release(event: Optional[bytes], done: bool) -> bytes:
        held, state["held"] = state["held"], event
        if held is None:
            return b""
        if not done:
            return held + b"\n\n"
        chunk = held_chunk(held)
        if chunk is not None and chunk.get("choices") == []:
            return b"data: " + json.dumps({**chunk, KEY: share.with_notes(share.record or {})}).encode() + b"\n\n"
        head = {k: chunk[k] for k in ("id", "created", "model") if k in chunk} if chunk else {}
        last = {**head, "object": "chat.completion.chunk", "choices": [], KEY: share.with_notes(share.record or {})}
        return held + b"\n\n" + b"data: " + json.dumps(last).encode() + b"\n\n"

    def fix(event: bytes) -> bytes:
        if event.strip() == b"data: [DONE]":
            return release(None, done=True) + event + b"\n\n"
        return release(event, done=False)

    def rewrite(message):
        events, more = split_events(state, message)
        body = b"".join(fix(e) for e in events)
        if not more:
            body += release(None, done=False)  # an answer cut short: what is held goes out
        return dict(message, body=body)

    return ok_body_send(send, rewrite)


def held_chunk(event: bytes) -> Optional[dict]:
    """The JSON of a ``data:`` event (None: not a JSON object)."""
    if not event.startswith(b"data: "):
        return None
    try:
        chunk = json.loads(event[len(b"data: ") :])
    except ValueError:
        return None
    return chunk if isinstance(chunk, dict) else None
