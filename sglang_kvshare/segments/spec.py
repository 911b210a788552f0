"""Annotation model, validation and per-segment tokenisation.

A request's prompt is an ordered list of segments: agent-private text (PF) or shared text (PH,
with a slot name). Each segment is tokenised on its own, so segment boundaries are token
boundaries. What travels to the scheduler is a :class:`WireSpec`: token spans, no text.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

from sglang_kvshare.methods import get_method

# namespace suffix shared by all agents of a workflow under the LR cache methods
LR_NAMESPACE = "__lr_shared__"


class AnnotationError(ValueError):
    """A malformed ``kvshare`` annotation; the message names the problem (HTTP 400)."""


FALLBACKS = ("dense", "rows")  # what a correction method recomputes when its gate rejects


@dataclass(frozen=True)
class Segment:
    text: str
    shared: bool
    slot: Optional[str] = None


@dataclass(frozen=True)
class KVShareAnnotation:
    workflow: str
    agent: str
    method: str
    segments: tuple[Segment, ...]
    # slot -> agent whose cache of that slot is the source (default: the most recent one)
    sources: Mapping[str, str] = field(default_factory=dict)
    recompute_ratio: Optional[float] = None
    tau: Optional[float] = None
    target_rho: Optional[float] = None
    fallback: Optional[str] = None  # "dense" | "rows" (None: the server's)
    fallback_block: Optional[int] = None
    recompute_head: Optional[int] = None  # rows at the start of an accepted correction recomputed
    kv_views: Optional[bool] = None  # False: copy shared segments even where views run (None: the server's)
    # an accepted correction as a KV leaf: True always, False never (None: --kvshare-leaf-policy)
    leaves: Optional[bool] = None


def _require_str(obj: Mapping, key: str, where: str) -> str:
    value = obj.get(key)
    if not isinstance(value, str) or not value.strip():
        raise AnnotationError(f"{where}.{key} must be a non-empty string, got {value!r}")
    return value


def parse_annotation(raw: Any, default_method: str) -> KVShareAnnotation:
    """Validate a JSON ``kvshare`` object; raises :class:`AnnotationError` on any defect."""
    if not isinstance(raw, Mapping):
        raise AnnotationError(f"kvshare must be an object, got {type(raw).__name__}")
    known = {
        "workflow",
        "agent",
        "method",
        "segments",
        "sources",
        "recompute_ratio",
        "tau",
        "target_rho",
        "fallback",
        "fallback_block",
        "recompute_head",
        "kv_views",
        "leaves",
    }
    unknown = sorted(set(raw) - known)
    if unknown:
        raise AnnotationError(f"kvshare has unknown keys {unknown}; known keys: {sorted(known)}")
    workflow = _require_str(raw, "workflow", "kvshare")
    agent = _require_str(raw, "agent", "kvshare")
    method = raw.get("method", default_method)
    if not isinstance(method, str):
        raise AnnotationError(f"kvshare.method must be a string, got {method!r}")
    try:
        get_method(method)
    except KeyError as e:
        raise AnnotationError(e.args[0]) from None

    segs_raw = raw.get("segments")
    if not isinstance(segs_raw, list) or not segs_raw:
        raise AnnotationError("kvshare.segments must be a non-empty list of segments")
    segments = []
    seen_slots: set[str] = set()
    for i, s in enumerate(segs_raw):
        where = f"kvshare.segments[{i}]"
        if not isinstance(s, Mapping):
            raise AnnotationError(f"{where} must be an object")
        extra = sorted(set(s) - {"text", "shared", "slot"})
        if extra:
            raise AnnotationError(f"{where} has unknown keys {extra}")
        text = s.get("text")
        if not isinstance(text, str):
            raise AnnotationError(f"{where}.text must be a string, got {type(text).__name__}")
        if text == "":
            raise AnnotationError(f"{where}.text is empty")
        shared = s.get("shared", False)
        if not isinstance(shared, bool):
            raise AnnotationError(f"{where}.shared must be true or false")
        slot = s.get("slot")
        if shared:
            if not isinstance(slot, str) or not slot.strip():
                raise AnnotationError(f"{where} is shared but has no slot name")
            if slot in seen_slots:
                raise AnnotationError(f"{where}: slot {slot!r} appears twice in one prompt")
            seen_slots.add(slot)
        elif slot is not None:
            raise AnnotationError(f"{where} names slot {slot!r} but is not shared")
        segments.append(Segment(text=text, shared=shared, slot=slot))

    sources = raw.get("sources", {})
    if not isinstance(sources, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) and v for k, v in sources.items()
    ):
        raise AnnotationError("kvshare.sources must map slot names to agent names")
    missing = sorted(set(sources) - seen_slots)
    if missing:
        raise AnnotationError(f"kvshare.sources names slots {missing} that no shared segment has")

    ratio = raw.get("recompute_ratio")
    if ratio is not None and (
        isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 <= ratio <= 1.0
    ):
        raise AnnotationError(f"kvshare.recompute_ratio must be a number in [0, 1], got {ratio!r}")
    tau = raw.get("tau")
    if tau is not None and (isinstance(tau, bool) or not isinstance(tau, (int, float)) or not 0.0 <= tau <= 1.0):
        raise AnnotationError(f"kvshare.tau must be a number in [0, 1], got {tau!r}")
    target_rho = raw.get("target_rho")
    if target_rho is not None and (
        isinstance(target_rho, bool) or not isinstance(target_rho, (int, float)) or not 0.0 < target_rho <= 1.0
    ):
        raise AnnotationError(f"kvshare.target_rho must be a number in (0, 1], got {target_rho!r}")
    if tau is not None and target_rho is not None:
        raise AnnotationError("kvshare.tau and kvshare.target_rho exclude each other: give one")
    fallback = raw.get("fallback")
    if fallback is not None and fallback not in FALLBACKS:
        raise AnnotationError(f"kvshare.fallback must be one of {list(FALLBACKS)}, got {fallback!r}")
    block = raw.get("fallback_block")
    if block is not None and (isinstance(block, bool) or not isinstance(block, int) or block < 1):
        raise AnnotationError(f"kvshare.fallback_block must be an integer >= 1, got {block!r}")
    head = raw.get("recompute_head")
    if head is not None and (isinstance(head, bool) or not isinstance(head, int) or head < 0):
        raise AnnotationError(f"kvshare.recompute_head must be an integer >= 0, got {head!r}")
    kv_views = raw.get("kv_views")
    if kv_views is not None and not isinstance(kv_views, bool):
        raise AnnotationError(f"kvshare.kv_views must be true or false, got {kv_views!r}")
    leaves = raw.get("leaves")
    if leaves is not None and not isinstance(leaves, bool):
        raise AnnotationError(f"kvshare.leaves must be true or false, got {leaves!r}")
    return KVShareAnnotation(
        workflow=workflow,
        agent=agent,
        method=method,
        segments=tuple(segments),
        sources=dict(sources),
        recompute_ratio=None if ratio is None else float(ratio),
        tau=None if tau is None else float(tau),
        target_rho=None if target_rho is None else float(target_rho),
        fallback=fallback,
        fallback_block=block,
        recompute_head=head,
        kv_views=kv_views,
        leaves=leaves,
    )


@dataclass(frozen=True)
class Span:
    """Tokens [start, end) of the prompt; ``slot`` is None for a PF segment."""

    start: int
    end: int
    slot: Optional[str] = None

    @property
    def shared(self) -> bool:
        return self.slot is not None

    def __len__(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class SegmentedPrompt:
    input_ids: list[int]
    spans: list[Span]


def tokenize_segments(
    segments: Sequence[Segment],
    encode: Callable[[str], list[int]],
    prefix_ids: Sequence[int] = (),
    slot_tokens: Optional[Callable[[str, str], Optional[list[int]]]] = None,
) -> SegmentedPrompt:
    """Tokenise each segment on its own and concatenate.

    encode: text -> token ids without special tokens added.
    prefix_ids: tokens the tokenizer puts before a prompt (e.g. BOS); they form a leading PF span.
    slot_tokens: (slot, text) -> token ids to use for a PH segment instead of encoding it (the
    exact output tokens of the agent that generated that text), or None to encode.
    """
    ids: list[int] = list(prefix_ids)
    spans: list[Span] = [Span(0, len(ids))] if ids else []
    for seg in segments:
        toks = None
        if seg.shared and slot_tokens is not None:
            toks = slot_tokens(seg.slot, seg.text)
        if toks is None:
            toks = list(encode(seg.text))
        if not toks:
            continue
        spans.append(Span(len(ids), len(ids) + len(toks), seg.slot if seg.shared else None))
        ids.extend(toks)
    return SegmentedPrompt(input_ids=ids, spans=spans)


@dataclass(frozen=True)
class WireSpec:
    """What the scheduler needs of an annotation (travels as a JSON string in custom_params)."""

    workflow: str
    agent: str
    method: str
    spans: tuple[Span, ...]
    sources: Mapping[str, str] = field(default_factory=dict)
    recompute_ratio: Optional[float] = None
    tau: Optional[float] = None
    target_rho: Optional[float] = None
    fallback: Optional[str] = None
    fallback_block: Optional[int] = None
    recompute_head: Optional[int] = None
    kv_views: Optional[bool] = None
    leaves: Optional[bool] = None
    # tokens prefilled for this request's context-free reference caches (charged to it)
    reference_tokens: int = 0
    # ReBaseShared LP: tokens of the earlier turns' adapter-free rebuilds this request waited for
    # (charged to it, it reads their cache) and how long it waited
    rebuild_tokens: int = 0
    rebuild_wait_ms: float = 0.0
    # ReBaseShared LP: on the adapter-free rebuild, the request id of the adapted turn it rebuilds
    # (whose own LR column the scheduler kept for it)
    rebuild_of: str = ""
    # automatic detection: the key under which this request's whole sequence (prompt and output)
    # becomes a source record, and per detected slot the tokens [start, end) of the earlier
    # sequence it repeats: slot -> (sequence key, start, end)
    sequence: str = ""
    ranges: Mapping[str, tuple[str, int, int]] = field(default_factory=dict)

    @property
    def namespace(self) -> str:
        """Radix-tree namespace (``extra_key``) of this agent's caches in this workflow; one
        namespace for all agents of the workflow under the PReCache (LR cache) methods."""
        if get_method(self.method).lr_sharing:
            return f"kvshare\x1f{self.workflow}\x1f{LR_NAMESPACE}"
        return f"kvshare\x1f{self.workflow}\x1f{self.agent}"

    def dumps(self) -> str:
        d = asdict(self)
        d["spans"] = [[s.start, s.end, s.slot] for s in self.spans]
        return json.dumps(d, separators=(",", ":"))

    @classmethod
    def loads(cls, raw: str) -> "WireSpec":
        d = json.loads(raw)
        d["spans"] = tuple(Span(a, b, slot) for a, b, slot in d["spans"])
        return cls(**d)
