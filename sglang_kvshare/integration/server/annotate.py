"""The ``kvshare`` annotation of a request body (HTTP process): validate it, tokenise each segment
on its own, and rewrite the body into SGLang's ``input_ids`` with the segment spec in
``sampling_params.custom_params`` and the agent's radix namespace in ``extra_key``. Each agent's
output token ids are remembered, so a later agent's ``out:<agent>`` segment uses exactly the
tokens whose KV the source holds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from cachetools import FIFOCache

from sglang_kvshare.methods import get_method
from sglang_kvshare.segments import AnnotationError, WireSpec, parse_annotation, tokenize_segments
from sglang_kvshare.segments.spec import KVShareAnnotation
from sglang_kvshare.segments.wire import KEY, output_agent

if TYPE_CHECKING:
    from sglang_kvshare.integration.server.host import Host


class OutputTokens:
    """(workflow, agent) -> (output text, output token ids), least recently written forgotten."""

    def __init__(self, capacity: int):
        self._items: FIFOCache = FIFOCache(capacity)

    def put(self, workflow: str, agent: str, text: str, ids: list[int]) -> None:
        self._items[(workflow, agent)] = (text, ids)

    def get(self, workflow: str, agent: str, text: str) -> Optional[list[int]]:
        item = self._items.get((workflow, agent))
        if item is None or item[0] != text:
            return None
        return list(item[1])


class AnnotationMixin:
    """The middleware's annotation rewrite and output memory (a part of ``host.Host``)."""

    def check_method(self: Host, ann: KVShareAnnotation, lora_path) -> None:
        """Refuse a method this server cannot run for this request (LR-cache methods)."""
        method = get_method(ann.method)
        if method.lr_sharing and not self.args.lr_cache:
            raise AnnotationError(
                f"method {ann.method} needs a server started with --enable-lora and --kvshare-lr-cache"
            )
        if self.args.lr_cache and lora_path is not None and (method.corrector or method.selector):
            raise AnnotationError(
                f"method {ann.method} corrects or recomputes K/V; on a --kvshare-lr-cache server LoRA "
                "agents use nonshared, fullshared, baseshared, prelr_shared, rebase_shared_lp or rebase_shared_db"
            )

    def tokenize(self: Host, ann: KVShareAnnotation) -> tuple[list[int], WireSpec]:
        """The prompt's token ids (each segment on its own; an ``out:<agent>`` segment as the
        output tokens that agent produced) and the spec the scheduler gets."""
        tok = self.get_tm().tokenizer

        def slot_tokens(slot: str, text: str):
            agent = output_agent(slot)
            return None if agent is None else self.outputs.get(ann.workflow, agent, text)

        prompt = tokenize_segments(
            ann.segments, lambda t: tok.encode(t, add_special_tokens=False), special_prefix(tok), slot_tokens
        )
        return prompt.input_ids, self.spec(ann, len(prompt.input_ids), prompt.spans)

    def spec(self: Host, ann: KVShareAnnotation, num_tokens: int, spans) -> WireSpec:
        """The spec the scheduler gets for a prompt of ``num_tokens`` cut into ``spans``."""
        context_len = self.get_tm().context_len
        if num_tokens >= context_len:
            raise AnnotationError(f"the prompt has {num_tokens} tokens; the model's context is {context_len} tokens")
        return WireSpec(
            workflow=ann.workflow,
            agent=ann.agent,
            method=ann.method,
            spans=tuple(spans),
            sources=ann.sources,
            recompute_ratio=ann.recompute_ratio,
            tau=ann.tau,
            target_rho=ann.target_rho,
            fallback=ann.fallback,
            fallback_block=ann.fallback_block,
            recompute_head=ann.recompute_head,
            kv_views=ann.kv_views,
            leaves=ann.leaves,
        )

    def rewrite(self: Host, payload: dict) -> tuple[KVShareAnnotation, WireSpec, dict]:
        """Validate and tokenise a ``/generate`` body; returns the annotation, its spec and the
        body to forward."""
        for key in ("text", "input_ids", "input_embeds"):
            if payload.get(key) is not None:
                raise AnnotationError(f"the prompt is given by kvshare.segments; do not also send '{key}'")
        ann = parse_annotation(payload[KEY], self.args.method)
        self.check_method(ann, payload.get("lora_path"))
        wire, out = self.forward_body(payload, ann)
        return ann, wire, out

    def forward_body(self: Host, payload: dict, ann: KVShareAnnotation) -> tuple[WireSpec, dict]:
        """``payload`` as SGLang gets it: the annotation's ``input_ids``, its spec in the sampling
        parameters, the agent's namespace (``extra_key``)."""
        input_ids, wire = self.tokenize(ann)
        return wire, self.body_with(payload, input_ids, wire)

    @staticmethod
    def body_with(payload: dict, input_ids: list[int], wire: WireSpec) -> dict:
        out = {k: v for k, v in payload.items() if k not in (KEY, "text")}
        out["input_ids"] = input_ids
        out["sampling_params"] = with_spec(out.get("sampling_params"), wire)
        out["extra_key"] = wire.namespace
        return out

    def remember(self: Host, ann: KVShareAnnotation, out) -> None:
        """Keep the agent's output token ids (``out``: a parsed answer with ``output_ids`` and
        ``text``)."""
        if not isinstance(out, dict) or "output_ids" not in out:
            return
        ids = exact_output_ids(self.get_tm().tokenizer, out["output_ids"], out.get("text", ""))
        if ids:
            self.outputs.put(ann.workflow, ann.agent, out.get("text", ""), ids)


def exact_output_ids(tok, output_ids, text: str) -> Optional[list[int]]:
    """The output tokens that stand for ``text`` when a later prompt quotes it: trailing special
    tokens dropped; None unless they decode to exactly ``text``."""
    ids = without_trailing_special(tok, output_ids)
    return ids if ids and tok.decode(ids) == text else None


def without_trailing_special(tok, output_ids) -> list[int]:
    """``output_ids`` without the special tokens (end of turn, EOS) at their end."""
    ids = list(output_ids)
    special = set(getattr(tok, "all_special_ids", []) or [])
    while ids and ids[-1] in special:
        ids.pop()
    return ids


def special_prefix(tok) -> list[int]:
    """Token ids the tokenizer puts before any prompt (e.g. BOS), found by encoding a probe."""
    probe = "a"
    with_special = tok.encode(probe, add_special_tokens=True)
    without = tok.encode(probe, add_special_tokens=False)
    if len(with_special) > len(without) and with_special[-len(without) :] == without:
        return with_special[: len(with_special) - len(without)]
    return []


def with_spec(sampling_params: Optional[dict], wire: WireSpec) -> dict:
    """Sampling parameters that carry ``wire`` to the scheduler (in ``custom_params``)."""
    sp = dict(sampling_params or {})
    sp["custom_params"] = {**(sp.get("custom_params") or {}), KEY: wire.dumps()}
    return sp
