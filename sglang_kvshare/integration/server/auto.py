"""Automatic sharing for requests without an annotation (HTTP process; ``--kvshare-auto METHOD``
or the ``X-KVShare-Method`` header): the middleware's part.

A chat or ``/generate`` request in a scope (``segments.detect.scope_of``) gets its shared pieces
detected from what the scope sent and produced before (``segments.detect.ScopeMemory``) and runs
as an annotated request of workflow = scope, agent = its identity (``segments.detect.agent_of``):
chat through SGLang's own chat serving (``chat.py``, whose annotation keeps a piece only where the
segment-wise token ids are SGLang's own), ``/generate`` as ``input_ids``. Its answer is remembered
as the agent's response in the scope. Requests without a scope, and every request when detection
is off, pass untouched.

A request that refers to earlier turns this worker never served (behind a router without the
routing-key header) is marked ``sources_missing`` in its record and counted; the first such
request of a workflow is logged, naming the header.
"""

from __future__ import annotations

import logging
from typing import Optional

from cachetools import FIFOCache

from sglang_kvshare.integration.server.annotate import special_prefix
from sglang_kvshare.integration.server.chat import ChatShare
from sglang_kvshare.integration.server.share import RequestShare
from sglang_kvshare.methods import method_names
from sglang_kvshare.segments import parse_annotation
from sglang_kvshare.segments.detect import Piece, ScopeMemory, agent_of, method_of, scope_of, token_spans

logger = logging.getLogger(__name__)


class AutoMixin:
    """Needs ``args``, ``get_tm``, ``check_method``, ``tokenize``, ``hand_on`` and ``outputs``;
    keeps ``scopes`` and ``seen`` (set up by :meth:`init_auto`)."""

    def init_auto(self) -> None:
        self.scopes: FIFOCache = FIFOCache(self.args.max_workflows)  # workflow -> ScopeMemory
        self.seen: FIFOCache = FIFOCache(16 * self.args.max_workflows)  # workflows served here
        self.missing_logged: FIFOCache = FIFOCache(self.args.max_workflows)

    def note_sources(self, workflow: str, refers_back: bool) -> bool:
        """Whether a request of ``workflow`` that ``refers_back`` to earlier turns finds none of
        them on this worker (its KV sources are elsewhere); logged once per workflow."""
        missing = refers_back and workflow not in self.seen
        self.seen[workflow] = None
        if missing and workflow not in self.missing_logged:
            self.missing_logged[workflow] = None
            logger.warning(
                "kvshare: workflow %r refers to earlier turns this worker never served, so their KV "
                "cannot be reused here; behind a router, send every request of a workflow with the "
                "header X-KVShare-Workflow (the routing key)", workflow)
        return missing

    def auto_method(self, headers) -> Optional[str]:
        default = None if self.args.auto == "off" else self.args.auto
        return method_of(headers, default, method_names())

    def detection(self, headers, method: str, messages, user, lora_path) -> Optional[tuple[dict, dict]]:
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

    def memory(self, workflow: str) -> ScopeMemory:
        mem = self.scopes.get(workflow)
        if mem is None:
            mem = self.scopes[workflow] = ScopeMemory()
        return mem

    def count_tokens(self, text: str) -> int:
        return len(self.get_tm().tokenizer.encode(text, add_special_tokens=False))

    def remember_response(self, workflow: str, agent: str, text: str) -> None:
        self.memory(workflow).add_response(agent, text)

    async def auto_chat(self, scope, receive, send, body: dict, method: str) -> bool:
        """Hand a chat request on with its detected pieces; False: not in a scope (untouched)."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            return False  # SGLang's own validation answers
        found = self.detection(scope["headers"], method, messages, body.get("user"), body.get("lora_path"))
        if found is None:
            return False
        raw, auto = found
        missing = self.note_sources(raw["workflow"], any(m.get("role") == "assistant" for m in messages))
        contents = [m.get("content") if isinstance(m.get("content"), str) else None for m in messages]
        pieces = self.memory(raw["workflow"]).detect(raw["agent"], contents, self.count_tokens,
                                                     self.args.auto_min_tokens)
        share = ChatShare(self, raw=raw, pieces=pieces, auto=auto, sources_missing=missing)
        await self.hand_on(scope, receive, send, body, share)
        return True

    def auto_generate(self, headers, payload: dict, method: str) -> Optional[tuple[RequestShare, dict]]:
        """A ``/generate`` request with one ``text`` prompt, its detected pieces (earlier
        responses quoted in it; its blank-line-separated paragraphs as contents) as an annotated
        request: (its share, the body to forward); None: left untouched."""
        text = payload.get("text")
        if not isinstance(text, str) or not text or payload.get("input_ids") is not None:
            return None
        found = self.detection(headers, method, [], payload.get("user"), payload.get("lora_path"))
        if found is None:
            return None
        raw, auto = found
        self.note_sources(raw["workflow"], False)
        pieces = self.memory(raw["workflow"]).detect_text(raw["agent"], text, self.count_tokens,
                                                          self.args.auto_min_tokens)
        stock = self.get_tm().tokenizer.encode(text)
        found = self.detected(raw, pieces, auto, text, stock)
        if found is None:
            return None
        ann, wire = found
        body = {k: v for k, v in payload.items() if k != "text"}
        return RequestShare(self, ann, stock, wire, auto=auto), self.body_with(body, stock, wire)

    def detected(self, raw: dict, pieces: list[Piece], auto: dict, text: str, stock_ids: list[int]):
        """(annotation, spec) of the detected ``pieces`` in a prompt ``text`` that the server
        tokenises as ``stock_ids``: each piece is the stock tokens wholly inside it, so the
        request computes exactly what it would without sharing; None when ``text`` does not
        re-tokenise to ``stock_ids``. ``auto`` (the record's) lists kept and dropped pieces."""
        tok = self.get_tm().tokenizer
        prefix = special_prefix(tok)
        shown = tok.decode(prefix)
        if prefix and text.startswith(shown):
            text = text[len(shown):]
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        shift = len(stock_ids) - len(enc["input_ids"])
        if shift not in (0, len(prefix)) or list(stock_ids[shift:]) != list(enc["input_ids"]):
            auto.update(detected=[], dropped=[p.record() for p in pieces])
            return None
        kept, dropped, spans = token_spans(pieces, text, enc["offset_mapping"], shift)
        auto.update(detected=[p.record() for p in kept], dropped=[p.record() for p in dropped])
        ann = parse_annotation({**raw, "segments": [{"text": text}]}, raw["method"])
        return ann, self.spec(ann, len(stock_ids), spans)
