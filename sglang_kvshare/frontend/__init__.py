"""SGLang frontend language support: agent roles and shared context in ``@sgl.function`` programs.

A frontend program builds its prompt as one string (``StreamExecutor.text_``) and every
``sgl.gen`` hands that string to the backend's ``generate``. The hook is therefore a backend:
:class:`KVShareEndpoint`, a :class:`sglang.RuntimeEndpoint` whose ``generate`` /
``generate_stream`` turn the accumulated text into a ``kvshare`` annotation. The program marks
what is what with two helpers that return ordinary strings (so they pass through ``s += ...``,
``sgl.user(...)``, f-strings and ``+`` unchanged):

- :func:`agent_role` declares which agent the program speaks for (``kvshare.agent``), optionally
  with a system prompt (rendered as ``sgl.system(...)`` by the chat template) and a LoRA adapter
  name sent as ``lora_path``;
- :func:`shared` wraps a span of text as a shared (PH) segment with a slot name;
  :func:`agent_output` is ``shared(text, "out:<agent>")`` for an earlier agent's output.

Both are written into the text as Unicode private-use markers (U+E000..U+E004), which the
endpoint parses back: text outside ``shared`` spans becomes private (PF) segments, the marker
characters never reach the model. Programs without markers are sent exactly as stock
``RuntimeEndpoint`` sends them.

.. code-block:: python

    import sglang as sgl
    from sglang_kvshare.frontend import KVShareEndpoint, agent_role, agent_output, shared

    @sgl.function
    def agent(s, name, system_prompt, question, earlier):
        s += agent_role(name, system_prompt=system_prompt)
        s += sgl.user(shared(question, "q") + "".join(
            f"\\n\\n{who} wrote:\\n" + agent_output(who, text) for who, text in earlier))
        s += sgl.assistant(sgl.gen("answer", max_tokens=64))

    sgl.set_default_backend(KVShareEndpoint("http://127.0.0.1:30000", workflow="wf-1",
                                            method="fullshared", chat_template_name="chatml"))
    a = agent.run(name="solver", system_prompt="You solve.", question=q, earlier=[])
    b = agent.run(name="critic", system_prompt="You check.", question=q,
                  earlier=[("solver", a["answer"])])
    b.get_meta_info("answer")["kvshare"]   # segments with mode "injected" for q and out:solver

Limits: one agent per program state (one request = one agent turn; run one program per turn, as
SGLang's own multi-agent examples do); ``sgl.gen(choices=...)`` (select), ``sgl.image`` and
the lazy/prefix-caching calls are sent as plain text without sharing (markers stripped); an
agent's output is shared by passing its ``state[var]`` text unchanged to :func:`agent_output`.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Dict, List, Mapping, Optional, Tuple

from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint
from sglang.lang.global_config import global_config
from sglang.lang.ir import SglConstantText, SglExprList, SglRoleBegin, SglRoleEnd, SglSamplingParams
from sglang.utils import http_request

__all__ = [
    "AgentHeader",
    "KVShareEndpoint",
    "MarkupError",
    "agent_output",
    "agent_role",
    "build_request",
    "kvshare_meta",
    "parse_marked",
    "plain_text",
    "shared",
]

# Unicode private-use characters: never produced by tokenizers' decoders for real text.
AGENT_OPEN, AGENT_CLOSE = "\ue000", "\ue001"
SHARED_OPEN, SLOT_END, SHARED_CLOSE = "\ue002", "\ue003", "\ue004"
_MARKERS = AGENT_OPEN + AGENT_CLOSE + SHARED_OPEN + SLOT_END + SHARED_CLOSE
_MARKER_RE = re.compile(f"[{_MARKERS}]")
OUTPUT_SLOT_PREFIX = "out:"


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
    return shared(text, OUTPUT_SLOT_PREFIX + agent)


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


_STRIP_RE = re.compile(
    f"{AGENT_OPEN}[^{AGENT_CLOSE}]*{AGENT_CLOSE}|{SHARED_OPEN}[^{SLOT_END}]*{SLOT_END}|[{_MARKERS}]"
)


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
    text: str,
    sampling: Dict[str, Any],
    *,
    workflow: str,
    method: Optional[str],
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
    body: Dict[str, Any] = {"sampling_params": sampling, "kvshare": ann}
    if header.lora_path is not None:
        body["lora_path"] = header.lora_path
    return body


def kvshare_meta(meta_info: Optional[Mapping[str, Any]]) -> Dict[str, Any]:
    """``meta_info["kvshare"]`` as a dict ({} if absent). Streamed chunks currently carry it as a
    one-element list; this unwraps it."""
    kv = (meta_info or {}).get("kvshare") or {}
    if isinstance(kv, list):
        kv = kv[0] if kv else {}
    return dict(kv)


_DEFAULT_TEMPLATES = (("smollm", "chatml"),)


class KVShareEndpoint(RuntimeEndpoint):
    """``sgl.RuntimeEndpoint`` for a ``sglang_kvshare`` server; generation calls of programs that
    use :func:`agent_role` / :func:`shared` are sent with a ``kvshare`` annotation.

    workflow: default ``kvshare.workflow`` (a fresh ``sgl-<hex>`` id if None); see
        :meth:`new_workflow`. One workflow = one run of the multi-agent task.
    method: default ``kvshare.method`` (None: the server's ``--kvshare-method``).
    chat_template_name: as for RuntimeEndpoint; when None and SGLang's model-path matching finds
        only its ``default`` template, SmolLM2 paths get ``chatml`` (their real template).
    """

    def __init__(
        self,
        base_url: str,
        workflow: Optional[str] = None,
        method: Optional[str] = None,
        *,
        api_key: Optional[str] = None,
        verify: Optional[str] = None,
        chat_template_name: Optional[str] = None,
    ):
        super().__init__(base_url.rstrip("/"), api_key=api_key, verify=verify, chat_template_name=chat_template_name)
        if chat_template_name is None and self.chat_template.name == "default":
            from sglang.lang.chat_template import get_chat_template

            path = self.model_info.get("model_path", "").lower()
            for needle, name in _DEFAULT_TEMPLATES:
                if needle in path:
                    self.chat_template = get_chat_template(name)
        self.workflow = workflow or self._fresh_id()
        self.method = method

    @staticmethod
    def _fresh_id() -> str:
        return f"sgl-{uuid.uuid4().hex[:12]}"

    def new_workflow(self, workflow: Optional[str] = None) -> str:
        """Start a new default workflow id (programs run afterwards belong to it); returns it."""
        self.workflow = workflow or self._fresh_id()
        return self.workflow

    # ------------------------------------------------------------------ request building

    def _sampling(self, sampling_params: SglSamplingParams) -> Dict[str, Any]:
        # as RuntimeEndpoint.generate builds it
        return {
            "skip_special_tokens": global_config.skip_special_tokens_in_output,
            "spaces_between_special_tokens": global_config.spaces_between_special_tokens_in_out,
            **sampling_params.to_srt_kwargs(),
        }

    def _annotated(self, s, sampling_params: SglSamplingParams) -> Optional[Dict[str, Any]]:
        """The annotated request body, or None for a program without markup (stock path)."""
        if not _MARKER_RE.search(s.text_):
            return None
        self._handle_dtype_to_regex(sampling_params)
        data = build_request(s.text_, self._sampling(sampling_params), workflow=self.workflow, method=self.method)
        if s.images_:
            raise MarkupError("images are not supported together with kvshare segments")
        for item in ("return_logprob", "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs"):
            value = getattr(sampling_params, item, None)
            if value is not None:
                data[item] = value
        return data

    # ------------------------------------------------------------------ BaseBackend API

    def generate(self, s, sampling_params: SglSamplingParams):
        data = self._annotated(s, sampling_params)
        if data is None:
            return super().generate(s, sampling_params)
        res = http_request(self.base_url + "/generate", json=data, api_key=self.api_key, verify=self.verify)
        self._assert_success(res)
        obj = res.json()
        return obj["text"], obj["meta_info"]

    def generate_stream(self, s, sampling_params: SglSamplingParams):
        data = self._annotated(s, sampling_params)
        if data is None:
            yield from super().generate_stream(s, sampling_params)
            return
        data["stream"] = True
        res = http_request(
            self.base_url + "/generate", json=data, stream=True, api_key=self.api_key, verify=self.verify
        )
        self._assert_success(res)
        pos = 0
        for chunk in res.iter_lines(decode_unicode=False):
            chunk = chunk.decode("utf-8")
            if chunk and chunk.startswith("data:"):
                if chunk == "data: [DONE]":
                    break
                obj = json.loads(chunk[5:].strip("\n"))
                meta = dict(obj["meta_info"])
                if "kvshare" in meta:
                    meta["kvshare"] = kvshare_meta(meta)
                piece = obj["text"][pos:]
                pos += len(piece)
                yield piece, meta

    # Calls that have no kvshare form: send the plain text (markers stripped), no sharing.

    def select(self, s, choices, temperature, choices_method):
        return super().select(_plain_view(s), choices, temperature, choices_method)

    def commit_lazy_operations(self, s):
        return super().commit_lazy_operations(_plain_view(s))

    def fill_image(self, s):
        return super().fill_image(_plain_view(s))

    def cache_prefix(self, prefix_str: str):
        return super().cache_prefix(plain_text(prefix_str) if _MARKER_RE.search(prefix_str) else prefix_str)


def _plain_view(s):
    """A stand-in for a StreamExecutor with the markup stripped (for the stock code paths)."""
    if not _MARKER_RE.search(s.text_):
        return s
    return SimpleNamespace(text_=plain_text(s.text_), images_=s.images_)
