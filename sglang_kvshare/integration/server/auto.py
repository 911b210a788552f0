"""Automatic sharing for requests without an annotation (HTTP process; ``--kvshare-auto METHOD``
or the ``X-KVShare-Method`` header): the middleware's part.

A chat or ``/generate`` request in a scope (``segments.detect.scope_of``) runs as an annotated
request of workflow = scope, agent = its identity (``segments.detect.agent_of``): chat through
SGLang's own chat serving (``chat.py``), ``/generate`` as ``input_ids``. Its shared spans are the
runs of SGLang's own token ids of its prompt that repeat what the scope sent or produced before
(``segments.token_index``), each read from the earlier request's cached sequence at that range;
the prompt, and the output once complete, join the scope's index. Requests without a scope, and
every request when detection is off, pass untouched.

A request that refers to earlier turns this worker never served (behind a router without the
routing-key header) is marked ``sources_missing`` in its record and counted; the first such
request of a workflow is logged, naming the header.
"""

from __future__ import annotations

import bisect
from array import array
import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Optional, Sequence

from cachetools import FIFOCache

from sglang_kvshare.integration.server.annotate import special_prefix, without_trailing_special
from sglang_kvshare.integration.server.chat import ChatShare
from sglang_kvshare.integration.server.share import RequestShare
from sglang_kvshare.methods import method_names
from sglang_kvshare.segments import Span, parse_annotation
from sglang_kvshare.segments.detect import agent_of, method_of, paragraph_starts, scope_of
from sglang_kvshare.segments.labels import prompt_labels
from sglang_kvshare.segments.token_index import Entry, Run, TokenIndex

if TYPE_CHECKING:
    from sglang_kvshare.integration.server.host import Host

logger = logging.getLogger(__name__)


class AutoMixin:
    """Automatic detection (a part of ``host.Host``); keeps ``index``, ``seen`` and
    ``missing_logged`` (set up by :meth:`init_auto`)."""

    def init_auto(self: Host) -> None:
        a = self.args
        self.index = TokenIndex(a.auto_min_tokens, a.auto_scope_tokens, a.auto_index_tokens, a.max_workflows)
        self.seen: FIFOCache = FIFOCache(16 * a.max_workflows)  # workflows served here
        self.missing_logged: FIFOCache = FIFOCache(a.max_workflows)

    def note_sources(self: Host, workflow: str, refers_back: bool) -> bool:
        """Whether a request of ``workflow`` that ``refers_back`` to earlier turns finds none of
        them on this worker (its KV sources are elsewhere); logged once per workflow."""
        missing = refers_back and workflow not in self.seen
        self.seen[workflow] = None
        if missing and workflow not in self.missing_logged:
            self.missing_logged[workflow] = None
            logger.warning(
                "kvshare: workflow %r refers to earlier turns this worker never served, so their KV "
                "cannot be reused here; behind a router, send every request of a workflow with the "
                "header X-KVShare-Workflow (the routing key)",
                workflow,
            )
        return missing

    def auto_method(self: Host, headers) -> Optional[str]:
        default = None if self.args.auto == "off" else self.args.auto
        return method_of(headers, default, method_names())

    def detection(self: Host, headers, method: str, messages, user, lora_path) -> Optional[tuple[dict, dict]]:
        """(the annotation without segments, the record's ``auto`` object) of a request in a
        scope; None without a scope."""
        found = scope_of(headers, self.args.auto_scope == "server")
        if found is None:
            return None
        workflow, scope_from = found
        agent, agent_from = agent_of(messages, user)
        raw = {"workflow": workflow, "agent": agent, "method": method}
        self.check_method(parse_annotation({**raw, "segments": [{"text": "."}]}, method), lora_path)
        return raw, {"scope": scope_from, "agent": agent, "agent_from": agent_from, "method": method}

    def remember_response(self: Host, share: RequestShare, answer: dict) -> None:
        """Index a finished auto request's output tokens (after its prompt, in its sequence)."""
        ids = without_trailing_special(self.get_tm().tokenizer, answer.get("output_ids") or ())
        ann, wire, prompt = share.annotated()
        if ids and wire.sequence:
            entry = Entry(
                wire.sequence, ann.agent, "output", len(prompt), array("i", ids), [(0, len(ids), f"out:{ann.agent}")]
            )
            self.index.add(ann.workflow, entry)

    async def auto_chat(self: Host, scope, receive, send, body: dict, method: str) -> bool:
        """Hand a chat request on to be detected once rendered; False: not in a scope (untouched)."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            return False  # SGLang's own validation answers
        found = self.detection(scope["headers"], method, messages, body.get("user"), body.get("lora_path"))
        if found is None:
            return False
        raw, auto = found
        missing = self.note_sources(raw["workflow"], any(m.get("role") == "assistant" for m in messages))
        contents = [m["content"] for m in messages if isinstance(m.get("content"), str) and m["content"]]
        share = ChatShare(self, raw=raw, auto=auto, contents=contents, sources_missing=missing)
        await self.hand_on(scope, receive, send, body, share)
        return True

    def auto_generate(self: Host, headers, payload: dict, method: str) -> Optional[tuple[RequestShare, dict]]:
        """A ``/generate`` request with one ``text`` prompt as an annotated request with its
        detected spans (its blank-line-separated paragraphs as its "messages"): (its share, the
        body to forward); None: left untouched."""
        text = payload.get("text")
        if not isinstance(text, str) or not text or payload.get("input_ids") is not None:
            return None
        found = self.detection(headers, method, [], payload.get("user"), payload.get("lora_path"))
        if found is None:
            return None
        raw, auto = found
        self.note_sources(raw["workflow"], False)
        stock = self.get_tm().tokenizer.encode(text)
        ann, wire = self.detected(raw, auto, text, stock, paragraph_starts(text))
        body = {k: v for k, v in payload.items() if k != "text"}
        return RequestShare(self, ann, stock, wire, auto=auto), self.body_with(body, stock, wire)

    def detected(self: Host, raw: dict, auto: dict, text: str, stock_ids: list[int], starts: Sequence[int]):
        """(annotation, spec) of a prompt ``text`` that the server tokenises as ``stock_ids``, its
        messages starting at characters ``starts``: the runs of ``stock_ids`` that repeat the
        scope's indexed tokens become shared spans, read from their sources' ranges; the prompt
        joins the index. The token ids stay SGLang's own, so the request computes exactly what
        it would without sharing. ``auto`` (the record's) lists the runs and the time taken."""
        began = time.perf_counter()
        workflow, agent = raw["workflow"], raw["agent"]
        auto["earlier_requests"] = self.index.scope(workflow).requests
        key = self.index.next_key(workflow)
        try:
            runs = self.index.find(workflow, stock_ids[:-1])  # the last token is computed anyway
            labels = prompt_labels(len(stock_ids), runs, agent, self.message_of(text, stock_ids, starts))
            self.index.add(workflow, Entry(key, agent, "prompt", 0, array("i", stock_ids), labels))
        except Exception as e:  # the request runs unshared rather than fail
            logger.exception("kvshare: span detection failed; the request runs unshared")
            runs, auto["error"] = [], f"{type(e).__name__}: {e}"
        auto.update(detected=[r.record() for r in runs], detect_ms=round(1000 * (time.perf_counter() - began), 3))
        ann = parse_annotation({**raw, "segments": [{"text": text}]}, raw["method"])
        spec = self.spec(ann, len(stock_ids), run_spans(runs, len(stock_ids)))
        ranges = {r.slot: (r.source, r.src_start, r.src_end) for r in runs}
        return ann, replace(spec, sequence=key, ranges=ranges)

    def message_of(self: Host, text: str, stock_ids: list[int], starts: Sequence[int]) -> list[int]:
        """The message (index into ``starts``) of each token of ``stock_ids``, from the character
        offsets of ``text``'s tokens; all 0 when ``text`` does not re-tokenise to ``stock_ids``."""
        tok = self.get_tm().tokenizer
        prefix = special_prefix(tok)
        shown = tok.decode(prefix)
        skipped = len(shown) if prefix and text.startswith(shown) else 0
        enc = tok(text[skipped:], add_special_tokens=False, return_offsets_mapping=True)
        shift = len(stock_ids) - len(enc["input_ids"])
        if shift not in (0, len(prefix)) or list(stock_ids[shift:]) != list(enc["input_ids"]):
            return [0] * len(stock_ids)
        return [0] * shift + [max(bisect.bisect_right(starts, skipped + a) - 1, 0) for a, _ in enc["offset_mapping"]]


def run_spans(runs: Sequence[Run], n: int) -> list[Span]:
    """PF/PH spans covering ``n`` prompt tokens, one PH span per run."""
    spans, pos = [], 0
    for run in runs:
        if run.start > pos:
            spans.append(Span(pos, run.start))
        spans.append(Span(run.start, run.end, run.slot))
        pos = run.end
    if pos < n:
        spans.append(Span(pos, n))
    return spans
