"""Labels of indexed tokens (``--kvshare-auto``), which name the slots of detected runs.

Slot names (stable across the workflows of one app, so KVCMAS's per-slot anchor pools warm up):
every indexed token carries the *label* of where its text first appeared in the scope: ``out:A``
(agent ``A``'s output), ``ctx:A:<i>`` (a new prompt token of agent ``A`` in its message, or
``/generate`` paragraph, ``i``), or its source's label when reused. A run is cut where its source's
labels change, each part named by its label (``#2``, ``#3``... for a label met again in a prompt).
"""

from __future__ import annotations

from typing import Protocol, Sequence


class LabelledRun(Protocol):
    """A labelled run of a prompt (``token_index.Run``)."""

    @property
    def start(self) -> int: ...
    @property
    def end(self) -> int: ...
    @property
    def label(self) -> str: ...


def merge_short(parts: list[tuple[int, int, str]], k: int) -> list[tuple[int, int, str]]:
    """Contiguous labelled ``parts`` with each one shorter than ``k`` joined to the one before it
    (the first to the one after it), so a run stays whole without slivers of a few tokens."""
    out: list[tuple[int, int, str]] = []
    for a, b, label in parts:
        if out and (b - a < k or out[-1][1] - out[-1][0] < k):
            keep = out[-1][2] if out[-1][1] - out[-1][0] >= k or b - a < k else label
            out[-1] = (out[-1][0], b, keep)
        else:
            out.append((a, b, label))
    return out


def prompt_labels(
    n: int, runs: Sequence[LabelledRun], agent: str, message_of: Sequence[int]
) -> list[tuple[int, int, str]]:
    """Labels of a prompt of ``n`` tokens: each run's, elsewhere ``ctx:<agent>:<message>`` (token
    ``t`` in message ``message_of[t]``)."""
    labels: list[tuple[int, int, str]] = []

    def put(a: int, b: int, label: str) -> None:
        if labels and labels[-1][1] == a and labels[-1][2] == label:
            labels[-1] = (labels[-1][0], b, label)
        elif b > a:
            labels.append((a, b, label))

    pos = 0
    for run in list(runs) + [None]:
        stop = n if run is None else run.start
        while pos < stop:
            msg = message_of[pos] if pos < len(message_of) else 0
            end = pos + 1
            while end < stop and (message_of[end] if end < len(message_of) else 0) == msg:
                end += 1
            put(pos, end, f"ctx:{agent}:{msg}")
            pos = end
        if run is not None:
            put(run.start, run.end, run.label)
            pos = run.end
    return labels
