"""The request annotation: workflow, agent, method and the prompt as PF/PH segments."""

from sglang_kvshare.segments.spec import (
    AnnotationError,
    KVShareAnnotation,
    Segment,
    SegmentedPrompt,
    Span,
    WireSpec,
    parse_annotation,
    tokenize_segments,
)

__all__ = [
    "AnnotationError",
    "KVShareAnnotation",
    "Segment",
    "SegmentedPrompt",
    "Span",
    "WireSpec",
    "parse_annotation",
    "tokenize_segments",
]
