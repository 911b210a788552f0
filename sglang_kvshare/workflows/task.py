"""The unit a workflow runs: one benchmark item (loaded by ``benchmarks.datasets``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Dict, Tuple


@dataclass(frozen=True)
class Task:
    """One benchmark item.

    question: the text every agent sees as the shared question slot ``q``; for multiple choice it
        already lists the options as ``A) ...`` lines.
    reference: MC: the correct letter; GSM8K: the final number as written after ``####``;
        HumanEval: the canonical solution body.
    choices: option texts in letter order (MC only, else empty).
    extra: dataset-specific fields. HumanEval: ``prompt``, ``test``, ``entry_point``;
        MMLU: ``subject``; GPQA: ``subdomain``, ``domain``; GSM8K: ``solution``.
    """

    id: str
    dataset: str
    question: str
    reference: str
    choices: Tuple[str, ...] = ()
    extra: Dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)
