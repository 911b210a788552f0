"""The frontend markup: agent role and shared-span markers written into a program's text, parsed
back into a ``kvshare`` annotation (see the package docstring)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

from sglang.lang.ir import SglConstantText, SglExprList, SglRoleBegin, SglRoleEnd

from sglang_kvshare.segments.wire import KEY, one_record, output_slot

# Unicode private-use characters: never produced by tokenizers' decoders for real text.
AGENT_OPEN, AGENT_CLOSE = "\ue000", "\ue001"
SHARED_OPEN, SLOT_END, SHARED_CLOSE = "\ue002", "\ue003", "\ue004"
_MARKERS = AGENT_OPEN + AGENT_CLOSE + SHARED_OPEN + SLOT_END + SHARED_CLOSE
_MARKER_RE = re.compile(f"[{_MARKERS}]")


class MarkupError(ValueError):
    """Malformed agent/shared markup in a program's text (or marker characters inside text)."""


@dataclass(frozen=True)
class AgentHeader:
    """What :func:`agent_role` declared; ``None`` fields fall back to the endpoint's defaults."""

    name: str
    lora_path: Optional[str] = None
    workflow: Optional[str] = None
    method: Optional[str] = None
    sources: Mapping[str, str] = field(default_factory=dict)


def _check_clean(text: str, what: str) -> None:
    if _MARKER_RE.search(text):
        raise MarkupError(f"{what} contains kvshare marker characters (U+E000..U+E004)")


def shared(text: str, slot: str) -> str:
    """``text`` as a shared (PH) segment named ``slot``: agents of one workflow that put the same
    text under the same slot share its KV cache. Returns a plain string to add to the program."""
    text = str(text)
    if not isinstance(slot, str) or not slot.strip():
        raise MarkupError(f"shared(): slot must be a non-empty string, got {slot!r}")
    _check_clean(text, "shared() text")
    _check_clean(slot, "shared() slot")
    return f"{SHARED_OPEN}{slot}{SLOT_END}{text}{SHARED_CLOSE}"


def agent_output(agent: str, text: str) -> str:
    """An earlier agent's output as the shared slot ``out:<agent>``. Pass the generated text
    unchanged (e.g. ``state["answer"]``) so the server can use that agent's exact output tokens."""
    return shared(text, output_slot(agent))


def agent_role(
    name: str,
    system_prompt: Optional[str] = None,
    lora_path: Optional[str] = None,
    *,
    workflow: Optional[str] = None,
    method: Optional[str] = None,
    sources: Optional[Mapping[str, str]] = None,
):
    """Declare the agent this program state speaks for; add it first: ``s += agent_role(...)``.

    name: ``kvshare.agent`` (its generated output is the slot ``out:<name>`` for later agents).
    system_prompt: if given, rendered as ``sgl.system(system_prompt)`` (a private segment).
    lora_path: adapter name (as in ``--lora-paths name=path``) sent as the request's ``lora_path``.
    workflow, method: override the endpoint's ``workflow`` / ``method`` for this program.
    sources: ``kvshare.sources`` (slot -> agent whose cache of it to use).
    """
    if not isinstance(name, str) or not name.strip():
        raise MarkupError(f"agent_role(): name must be a non-empty string, got {name!r}")
    header = {"name": name}
    for key, value in (("lora_path", lora_path), ("workflow", workflow), ("method", method)):
        if value is not None:
            header[key] = value
    if sources:
        header["sources"] = dict(sources)
    blob = json.dumps(header, separators=(",", ":"))
    _check_clean(blob, "agent_role() arguments")
    marker = f"{AGENT_OPEN}{blob}{AGENT_CLOSE}"
    if system_prompt is None:
        return marker
    return SglExprList(
        [SglConstantText(marker), SglRoleBegin("system"), SglConstantText(system_prompt), SglRoleEnd("system")]
    )


_STRIP_RE = re.compile(f"{AGENT_OPEN}[^{AGENT_CLOSE}]*{AGENT_CLOSE}|{SHARED_OPEN}[^{SLOT_END}]*{SLOT_END}|[{_MARKERS}]")


def plain_text(text: Any) -> str:
    """The text with all kvshare markup removed (what the model sees); accepts a ProgramState.
    Tolerates a cut-off prefix of a program's text."""
    if not isinstance(text, str):
        text = text.text()
    return _STRIP_RE.sub("", text)


def parse_marked(text: str) -> Tuple[Optional[AgentHeader], List[Dict[str, Any]]]:
    """Split a program's text into its agent header (None if undeclared) and protocol segments.

    Text outside ``shared`` spans becomes private segments (adjacent pieces merged); empty shared
    spans are dropped (an empty segment has nothing to share).
    """
    header: Optional[AgentHeader] = None
    segments: List[Dict[str, Any]] = []
    private: List[str] = []
    pos = 0

    def flush_private():
        if private:
            joined = "".join(private)
            private.clear()
            if joined:
                segments.append({"text": joined, "shared": False})

    while pos < len(text):
        m = _MARKER_RE.search(text, pos)
        if m is None:
            private.append(text[pos:])
            break
        private.append(text[pos : m.start()])
        ch = m.group()
        if ch == AGENT_OPEN:
            end = text.find(AGENT_CLOSE, m.end())
            if end < 0:
                raise MarkupError("unterminated agent_role() marker")
            raw = json.loads(text[m.end() : end])
            new = AgentHeader(
                name=raw["name"],
                lora_path=raw.get("lora_path"),
                workflow=raw.get("workflow"),
                method=raw.get("method"),
                sources=raw.get("sources", {}),
            )
            if header is not None and header != new:
                raise MarkupError(
                    f"one program state speaks for one agent: agent_role({header.name!r}) and "
                    f"agent_role({new.name!r}) in the same text"
                )
            header = new
            pos = end + 1
        elif ch == SHARED_OPEN:
            slot_end = text.find(SLOT_END, m.end())
            close = text.find(SHARED_CLOSE, m.end())
            if slot_end < 0 or close < 0 or close < slot_end:
                raise MarkupError("unterminated shared() marker")
            slot, body = text[m.end() : slot_end], text[slot_end + 1 : close]
            _check_clean(body, f"shared span {slot!r}")
            if body:
                flush_private()
                segments.append({"text": body, "shared": True, "slot": slot})
            pos = close + 1
        else:
            raise MarkupError(f"stray kvshare marker U+{ord(ch):04X} at offset {m.start()}")
    flush_private()
    return header, segments


def build_request(
    text: str, sampling: Dict[str, Any], *, workflow: str, method: Optional[str]
) -> Optional[Dict[str, Any]]:
    """The POST /generate body for a marked program text, or None when it has no markup (then
    the stock request applies). Raises :class:`MarkupError` for shared spans without an agent."""
    if not _MARKER_RE.search(text):
        return None
    header, segments = parse_marked(text)
    if header is None:
        raise MarkupError("the program marks shared() text but declares no agent: add agent_role(name) first")
    if not segments:
        raise MarkupError(f"agent {header.name!r}: the prompt is empty")
    ann: Dict[str, Any] = {"workflow": header.workflow or workflow, "agent": header.name, "segments": segments}
    method = header.method or method
    if method is not None:
        ann["method"] = method
    if header.sources:
        ann["sources"] = dict(header.sources)
    body: Dict[str, Any] = {"sampling_params": sampling, KEY: ann}
    if header.lora_path is not None:
        body["lora_path"] = header.lora_path
    return body


def kvshare_meta(meta_info: Optional[Mapping[str, Any]]) -> Dict[str, Any]:
    """``meta_info["kvshare"]`` as a dict ({} if absent; a list of records is collapsed to one)."""
    return dict(one_record((meta_info or {}).get(KEY)) or {})
