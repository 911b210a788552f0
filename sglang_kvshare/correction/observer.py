"""Dense-fallback observations, factorised beside the scheduler.

After a dense fallback a corrector ``prepare``s the observed correction (delta and truncated-SVD
factors: on 2 CPU cores about a second of LAPACK work per 2K-token segment) and ``record``s it
(list operations). In ``background`` mode (the default) ``prepare`` runs in a one-thread child
process at a lower CPU priority: it never runs inside a scheduler step, and it does not fight
the model's threads for the cores (multi-threaded LAPACK beside a busy OpenMP team slows both
by an order of magnitude). The scheduler ``collect``s finished results at the start of its next
step and records them there. ``inline`` mode prepares and records at once, inside the step.

Tensors travel through shared memory (``torch.multiprocessing``'s pickling), not pipes.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Deque, Optional

from sglang_kvshare.correction import create_corrector

logger = logging.getLogger(__name__)

MODES = ("background", "inline")
_CHILD_NICE = 10  # CFS weight 110 vs 1024: the child mostly runs while the scheduler waits


def _init_child() -> None:
    import torch

    torch.set_num_threads(1)
    try:
        os.nice(_CHILD_NICE)
    except OSError:  # pragma: no cover - not permitted
        pass


def _prepare(name: str, config: Any, args: tuple) -> Any:
    """Child side: the named corrector's pure ``prepare`` (a stateless instance per config)."""
    return create_corrector(name, config=config).prepare(*args)


@dataclass
class _Job:
    future: Future
    record: Callable[[Any], None]


class Observer:
    """Runs correctors' ``prepare`` off the scheduler step; results are recorded in FIFO order
    by ``collect`` (scheduler thread only)."""

    def __init__(self, mode: str = "background") -> None:
        if mode not in MODES:
            raise ValueError(f"observe mode must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self._pool: Optional[ProcessPoolExecutor] = None
        self._jobs: Deque[_Job] = deque()
        self.num_done = 0
        self.num_failed = 0

    @property
    def pending(self) -> int:
        return len(self._jobs)

    def _executor(self) -> ProcessPoolExecutor:
        if self._pool is None:
            import multiprocessing

            import torch.multiprocessing  # noqa: F401  (tensor pickling through shared memory)

            self._pool = ProcessPoolExecutor(
                max_workers=1, mp_context=multiprocessing.get_context("spawn"), initializer=_init_child
            )
        return self._pool

    def submit(self, corrector, args: tuple, record: Callable[[Any], None]) -> None:
        """Prepare ``corrector.prepare(*args)`` and pass the result to ``record`` (in the
        scheduler thread: at once inline, else at a later ``collect``)."""
        if self.mode == "inline":
            record(corrector.prepare(*args))
            self.num_done += 1
            return
        args = tuple(_shared(a) for a in args)
        future = self._executor().submit(_prepare, corrector.name, corrector.config, args)
        self._jobs.append(_Job(future, record))

    def collect(self, wait: bool = False) -> int:
        """Record every finished job in submission order (all of them when ``wait``); returns
        how many were recorded."""
        n = 0
        while self._jobs and (wait or self._jobs[0].future.done()):
            job = self._jobs.popleft()
            try:
                result = job.future.result()
            except Exception:  # a failed factorisation loses one anchor, never the server
                logger.exception("kvshare: preparing an observation failed")
                self.num_failed += 1
                continue
            job.record(result)
            self.num_done += 1
            n += 1
        return n


def _shared(obj):
    """A SegmentKV (or None) with its tensors in shared memory, so pickling sends handles."""
    if obj is None or not hasattr(obj, "k"):
        return obj
    return type(obj)(obj.k.contiguous().share_memory_(), obj.v.contiguous().share_memory_())
