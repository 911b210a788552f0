"""Automatic shared-span detection (``--kvshare-auto``) for requests that carry no annotation.

Plain bookkeeping over text, no engine: who is asking (:func:`scope_of`, :func:`agent_of`), which
parts of a prompt other requests of the same scope already sent or produced
(:class:`ScopeMemory`), and where those parts are in the server's own tokenisation of the prompt
(:func:`token_spans`).

Rules, per request of a scope (the ``X-KVShare-Workflow`` header, else the API key):

- a message content, or a text span inside one, that equals an earlier response of the scope is
  the shared slot ``out:<that agent>`` (its source is that response's cache);
- a message content of at least ``min_tokens`` tokens is a shared slot named after the first
  request of the scope that sent it (``ctx:<agent>:<message index>``, stable across workflows of
  one app, so per-slot anchor pools warm up): the first time it is computed and becomes a source,
  later requests reuse it.
"""

from __future__ import annotations

import bisect
import hashlib
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

from cachetools import FIFOCache

from sglang_kvshare.segments.spec import AnnotationError, Span
from sglang_kvshare.segments.wire import output_slot

WORKFLOW_HEADER = "x-kvshare-workflow"
METHOD_HEADER = "x-kvshare-method"
OPT_OUT = "none"
MAX_HEADER_LEN = 256
# a response shorter than this is not searched for inside other messages (it would match anywhere)
MIN_QUOTED_CHARS = 32
# a paragraph of a /generate prompt: text between blank lines
_PARAGRAPH = re.compile(r"\S(?:[^\n]|\n(?!\s*\n))*")


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def header(headers: Sequence[tuple[bytes, bytes]], name: str) -> Optional[str]:
    """The value of header ``name`` (lower case) in ASGI ``headers``; None when absent."""
    for key, value in headers:
        if key.decode("latin-1").lower() == name:
            return value.decode("latin-1")
    return None


def scope_of(headers: Sequence[tuple[bytes, bytes]], server_scope: bool) -> Optional[tuple[str, str]]:
    """(workflow, where it came from) of a request: the ``X-KVShare-Workflow`` header, else the
    API key (hashed), else the one server-wide scope if ``server_scope``; None: no scope, nothing
    is shared. A malformed header raises :class:`AnnotationError` naming it."""
    value = header(headers, WORKFLOW_HEADER)
    if value is not None:
        if not value or len(value) > MAX_HEADER_LEN or not value.isascii() or not value.isprintable():
            raise AnnotationError(
                f"header X-KVShare-Workflow must be 1-{MAX_HEADER_LEN} printable ASCII characters, got {value!r}"
            )
        return value, "header"
    auth = header(headers, "authorization")
    if auth and auth.lower().startswith("bearer ") and auth[7:].strip():
        return "key-" + _digest(auth[7:].strip()), "api_key"
    return ("server", "server") if server_scope else None


def method_of(headers: Sequence[tuple[bytes, bytes]], default: Optional[str], names: Sequence[str]) -> Optional[str]:
    """The sharing method of an unannotated request: ``X-KVShare-Method`` (``none`` opts out),
    else ``default`` (None: automatic detection is off)."""
    value = header(headers, METHOD_HEADER)
    if value is None:
        return default
    value = value.strip()
    if value == OPT_OUT:
        return None
    if value not in names:
        raise AnnotationError(f"header X-KVShare-Method must be one of {[OPT_OUT, *names]}, got {value!r}")
    return value


def agent_of(messages: Sequence[Any], user: Any) -> tuple[str, str]:
    """(agent, where it came from): the system message's ``name``, else the request's ``user``,
    else the system prompt (hashed), else one anonymous agent."""
    system = next((m for m in messages if isinstance(m, Mapping) and m.get("role") in ("system", "developer")), None)
    if system is not None and isinstance(system.get("name"), str) and system["name"]:
        return system["name"], "name"
    if isinstance(user, str) and user:
        return user, "user"
    if system is not None and isinstance(system.get("content"), str):
        return "sys-" + _digest(system["content"])[:10], "system_prompt"
    return "anonymous", "none"


@dataclass(frozen=True)
class Piece:
    """A detected shared span: ``text`` inside message ``message`` (the prompt for /generate)."""

    slot: str
    text: str
    message: int
    kind: str  # "output" (an earlier response) or "context" (an earlier request's content)
    source: Optional[str]  # the agent that produced or first sent it (None: sent here first)

    def record(self) -> dict:
        return {"slot": self.slot, "kind": self.kind, "message": self.message, "source_agent": self.source}


@dataclass
class ScopeMemory:
    """What one scope sent and produced: responses (text -> agent) and shared contents
    (digest -> (slot, agent that first sent it)); bounded, oldest forgotten first."""

    capacity: int = 256
    responses: FIFOCache = field(init=False)
    contexts: FIFOCache = field(init=False)

    def __post_init__(self) -> None:
        self.responses = FIFOCache(self.capacity)
        self.contexts = FIFOCache(4 * self.capacity)

    def add_response(self, agent: str, text: str) -> None:
        if text.strip():
            self.responses.pop(text, None)
            self.responses[text] = agent

    def _quotable(self) -> list[tuple[str, str]]:
        """(response, agent), newest first, of the responses long enough to search for in text."""
        return [(t, a) for t, a in reversed(list(self.responses.items())) if len(t) >= MIN_QUOTED_CHARS]

    def detect(self, agent: str, contents: Sequence[Optional[str]], count_tokens: Callable[[str], int],
               min_tokens: int) -> list[Piece]:
        """The shared pieces of a prompt whose messages have ``contents`` (None: not text), in
        prompt order; new long contents are remembered as this agent's."""
        pieces: list[Piece] = []
        used: set[str] = set()
        quoted = self._quotable()
        for i, content in enumerate(contents):
            if not content:
                continue
            found = self._outputs_in(content, i, quoted, used)
            if found:
                pieces += found
                continue
            if len(content) < min_tokens or count_tokens(content) < min_tokens:
                continue
            piece = self._context(agent, content, i, used)
            if piece is not None:
                pieces.append(piece)
                used.add(piece.slot)
        return pieces

    def detect_text(self, agent: str, text: str, count_tokens: Callable[[str], int], min_tokens: int) -> list[Piece]:
        """The shared pieces of one prompt text (``/generate``), in order: earlier responses
        quoted in it, and its blank-line-separated paragraphs as contents."""
        used: set[str] = set()
        quoted = self._quotable()
        found = [(text.find(p.text), p) for p in self._outputs_in(text, 0, quoted, used)]
        for k, m in enumerate(_PARAGRAPH.finditer(text)):
            at, para = m.start(), m.group()
            if any(a < at + len(para) and at < a + len(p.text) for a, p in found):
                continue
            if len(para) >= min_tokens and count_tokens(para) >= min_tokens:
                piece = self._context(agent, para, k, used)
                if piece is not None:
                    used.add(piece.slot)
                    found.append((at, piece))
        return [p for _, p in sorted(found, key=lambda f: f[0])]

    def _outputs_in(self, content: str, i: int, quoted, used: set) -> list[Piece]:
        """Earlier responses in ``content``: all of it, else non-overlapping quoted spans."""
        agent = self.responses.get(content)
        if agent is not None:
            slot = output_slot(agent)
            if slot in used:
                return []
            used.add(slot)
            return [Piece(slot, content, i, "output", agent)]
        found: list[tuple[int, Piece]] = []
        for text, agent in quoted:
            at, slot = content.find(text), output_slot(agent)
            if at < 0 or slot in used or any(a < at + len(text) and at < a + len(p.text) for a, p in found):
                continue
            used.add(slot)
            found.append((at, Piece(slot, text, i, "output", agent)))
        return [p for _, p in sorted(found, key=lambda f: f[0])]

    def _context(self, agent: str, content: str, i: int, used: set) -> Optional[Piece]:
        key = _digest(content)
        known = self.contexts.get(key)
        if known is not None:
            slot, first = known
            return None if slot in used else Piece(slot, content, i, "context", first)
        # named by who sent it first and where: stable across the workflows of an app (another
        # content sent there later takes the name over; the scheduler compares tokens)
        slot = f"ctx:{agent}:{i}"
        if slot in used:
            return None
        self.contexts[key] = (slot, agent)
        return Piece(slot, content, i, "context", None)


def token_spans(
    pieces: Sequence[Piece], text: str, offsets: Sequence[tuple[int, int]], shift: int = 0,
) -> tuple[list[Piece], list[Piece], list[Span]]:
    """Spans of the stock tokenisation of ``text`` (each token's character ``offsets``; the token
    ids start at ``shift`` in the prompt) for the pieces, found in order: a piece's span is the
    tokens that lie wholly inside its text, so the prompt's token ids stay the ones the server
    would use without sharing. Returns (kept, dropped: no whole token inside, PF/PH spans
    covering the prompt)."""
    starts = [a for a, _ in offsets]
    ends = [b for _, b in offsets]
    kept, dropped, bounds = [], [], []
    cursor, last = 0, 0
    for piece in pieces:
        at = text.find(piece.text, cursor)
        if at < 0:
            dropped.append(piece)
            continue
        cursor = at + len(piece.text)
        first = max(bisect.bisect_left(starts, at), last)
        end = bisect.bisect_right(ends, cursor)
        if end <= first:
            dropped.append(piece)
            continue
        kept.append(piece)
        bounds.append((first, end, piece.slot))
        last = end
    spans, pos = [Span(0, shift)] if shift else [], 0
    for first, end, slot in bounds:
        if first > pos:
            spans.append(Span(shift + pos, shift + first))
        spans.append(Span(shift + first, shift + end, slot))
        pos = end
    if pos < len(offsets):
        spans.append(Span(shift + pos, shift + len(offsets)))
    return kept, dropped, spans
