"""Automatic sharing (``--kvshare-auto``) for requests that carry no annotation: who is asking.

Plain bookkeeping over headers and messages, no engine: the scope a request shares within
(:func:`scope_of`), its agent (:func:`agent_of`), its method (:func:`method_of`), and where its
messages start in the rendered prompt (:func:`message_starts`, :func:`paragraph_starts`), which
names the slots of its new tokens. What repeats is found on token ids (``token_index``).
"""

from __future__ import annotations

import hashlib
import re
from typing import Any, Mapping, Optional, Sequence

from sglang_kvshare.segments.spec import AnnotationError

WORKFLOW_HEADER = "x-kvshare-workflow"
METHOD_HEADER = "x-kvshare-method"
OPT_OUT = "none"
MAX_HEADER_LEN = 256
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


def message_starts(text: str, contents: Sequence[str]) -> list[int]:
    """Where each message content starts in a rendered chat prompt ``text`` (found in order; a
    content not found is skipped)."""
    starts, cursor = [], 0
    for content in contents:
        at = text.find(content, cursor)
        if at >= 0:
            starts.append(at)
            cursor = at + len(content)
    return starts


def paragraph_starts(text: str) -> list[int]:
    """Where each paragraph (text between blank lines) of a ``/generate`` prompt starts: its
    "messages" in slot names."""
    return [m.start() for m in _PARAGRAPH.finditer(text)]
