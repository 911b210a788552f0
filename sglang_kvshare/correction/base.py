"""The contract between cross-agent KV correction methods and the integration layer.

All caches here are in CANONICAL coordinates: a segment's keys are de-rotated so the segment
starts at position 0 (the integration layer moves them to and from real positions with
``sglang_kvshare.rope.shift_keys``); the algorithms never see absolute positions.

Call sequence for one shared segment (slot) on the workflow edge source_agent -> target_agent:
1. ``correct(...)``: if ``accepted``, ``result.kv`` is the target agent's cache of the segment
   (the source cache for the next edge when ``chained``). Accepted results are never stored.
   With ``materialize=False`` only ``result.delta`` is returned (the caller adds it to the base
   itself, e.g. in a fused kernel); rows beyond ``corrected_len`` are then the source's.
2. Otherwise the caller prefills the segment densely for the target agent and calls
   ``observe(...)`` with that exact cache, which may update the method's correction state.
   ``observe`` is ``record(prepare(...))``: ``prepare`` is pure (reads the caches and the
   configuration only; it may run on another thread), ``record`` mutates the state.
``needs_reference``: the caller must also supply a context-free reference cache of the segment
(the segment prefilled with no preceding context), a prefill the caller has to count.

Correctors are not thread-safe: the caller serialises ``correct``, ``record`` and the queries
(one pool per process); ``prepare`` may run concurrently with them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import torch


@dataclass(frozen=True)
class SegmentKV:
    """One segment's cache in canonical coordinates.

    k, v: [n_layers, L, D] with D = kv_heads * head_dim, same dtype and device. Correctors never
    mutate the tensors they are given and never return views of them.
    """

    k: torch.Tensor
    v: torch.Tensor

    def __post_init__(self) -> None:
        if self.k.dim() != 3 or self.k.shape != self.v.shape:
            raise ValueError(f"k {tuple(self.k.shape)} and v {tuple(self.v.shape)} must both be [n_layers, L, D]")

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    @property
    def seq_len(self) -> int:
        return self.k.shape[1]

    @property
    def dim(self) -> int:
        return self.k.shape[2]

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


@dataclass(frozen=True)
class KVDelta:
    """An estimated correction of a segment's first rows: k, v [n_layers, rows, D] float32,
    canonical coordinates, to be added to the base cache those rows came from."""

    k: torch.Tensor
    v: torch.Tensor


@dataclass(frozen=True)
class GateBlock:
    """The gate's decision on rows [lo, hi) of a segment (``correct(..., block_size=...)``)."""

    lo: int
    hi: int
    entropy: float
    accepted: bool


@dataclass(frozen=True)
class CorrectionResult:
    """Outcome of ``Corrector.correct``.

    accepted: the caller may use ``kv`` instead of prefilling the segment.
    kv: when accepted, the full corrected cache (same length, dtype and device as the cache it
        corrects, canonical coordinates); rows ``corrected_len:`` are copied unchanged.
    entropy: the normalised gate entropy in [0, 1] when a gate ran, else None.
    num_anchors: anchors that took part in the gate (0 when none did).
    corrected_len: leading rows to which a correction was applied.
    reason: a short machine-readable word: "accepted", "partial" (accepted for some blocks only),
        "few_anchors", "entropy", "no_relation", ...
    delta: when accepted, the correction of rows ``:corrected_len`` relative to the base cache
        (the source when ``chained``, else the reference).
    anchor_bytes_per_token: the footprint of one anchor that took part (its base and the
        target's delta) per token it covers, averaged over those anchors (None when none did).
    blocks: with a block gate, the decision on each block of the gated rows (accepted: the
        correction holds where blocks were accepted; the caller recomputes ``rejected_rows``).
    """

    accepted: bool
    kv: Optional[SegmentKV]
    entropy: Optional[float]
    num_anchors: int
    corrected_len: int
    reason: str
    delta: Optional[KVDelta] = None
    anchor_bytes_per_token: Optional[float] = None
    blocks: Tuple[GateBlock, ...] = ()

    @property
    def rejected_rows(self) -> Tuple[Tuple[int, int], ...]:
        """[lo, hi) row ranges of the blocks the gate rejected, to be recomputed (an accepted
        result with a block gate; empty otherwise)."""
        return tuple((b.lo, b.hi) for b in self.blocks if not b.accepted) if self.accepted else ()

    @staticmethod
    def reject(
        reason: str,
        entropy: Optional[float] = None,
        num_anchors: int = 0,
        anchor_bytes_per_token=None,
        blocks: Tuple[GateBlock, ...] = (),
    ) -> "CorrectionResult":
        return CorrectionResult(
            False, None, entropy, num_anchors, 0, reason, anchor_bytes_per_token=anchor_bytes_per_token, blocks=blocks
        )


class Corrector(ABC):
    """A cross-agent KV correction method; one instance holds the state of one process.

    chained: corrections are relative to the source agent's materialised cache (KVCMAS) rather
        than to a context-free reference (non-chained: result = reference + delta_{j<-ref}).
    needs_reference: ``correct`` and ``observe`` need the context-free reference cache.
    """

    name: str
    chained: bool
    needs_reference: bool

    @abstractmethod
    def correct(
        self,
        slot: str,
        source_agent: str,
        target_agent: str,
        source: SegmentKV,
        reference: Optional[SegmentKV] = None,
        materialize: bool = True,
        tau: Optional[float] = None,
        block_size: Optional[int] = None,
    ) -> CorrectionResult:
        """Estimate the target agent's cache of segment ``slot``.

        source: the source agent's cache of the segment (materialised, possibly itself corrected;
            rows no correction covers are copied from it).
        reference: the context-free reference cache; required iff ``needs_reference``.
        materialize: also build ``result.kv`` (else only ``result.delta``).
        tau: the gate threshold for this call (None: the method's configured one).
        block_size: when the gate rejects the segment, gate blocks of this many rows separately
            (partial fallback, beyond the papers): the result is accepted when any block is, and
            names the rejected rows in ``blocks``; None: one decision for the segment. A method
            without a gate ignores it.
        Does not mutate the inputs; may update usage counters of the method's state.
        """

    @abstractmethod
    def prepare(
        self,
        slot: str,
        source_agent: str,
        target_agent: str,
        source: SegmentKV,
        target: SegmentKV,
        reference: Optional[SegmentKV] = None,
    ) -> Any:
        """The expensive, pure half of ``observe`` (factorisations); its result goes to ``record``.

        ``target`` is the target agent's exact cache of the segment after a dense fallback;
        source and target (and reference) have equal length. Copies what it keeps.
        """

    @abstractmethod
    def record(self, prepared: Any) -> Any:
        """Add a ``prepare`` result to the method's state."""

    def observe(
        self,
        slot: str,
        source_agent: str,
        target_agent: str,
        source: SegmentKV,
        target: SegmentKV,
        reference: Optional[SegmentKV] = None,
    ) -> None:
        """Record a dense fallback: ``record(prepare(...))``."""
        self.record(self.prepare(slot, source_agent, target_agent, source, target, reference))

    @abstractmethod
    def nbytes(self) -> int:
        """Bytes of correction state held (all stored factors and tensors)."""

    @abstractmethod
    def stats(self) -> dict:
        """Counters for metrics and tests (plain Python values)."""


def apply_delta(base: SegmentKV, source: SegmentKV, delta: KVDelta, num_rows: int, inplace: bool = False) -> SegmentKV:
    """The corrected cache: ``base + delta`` on rows ``:num_rows``, ``source`` beyond them (rows
    no correction covers keep the source agent's aligned cache). A new SegmentKV in source's
    dtype, or ``source`` itself, overwritten, when ``inplace`` (the caller owns it)."""
    out_k, out_v = (source.k, source.v) if inplace else (source.k.clone(), source.v.clone())
    if base is source and inplace and out_k.dtype == torch.float32:
        out_k[:, :num_rows] += delta.k[:, :num_rows]
        out_v[:, :num_rows] += delta.v[:, :num_rows]
    else:
        out_k[:, :num_rows] = (base.k[:, :num_rows].float() + delta.k[:, :num_rows]).to(out_k.dtype)
        out_v[:, :num_rows] = (base.v[:, :num_rows].float() + delta.v[:, :num_rows]).to(out_v.dtype)
    return source if inplace else SegmentKV(out_k, out_v)


def check_pair(a: SegmentKV, b: SegmentKV, what: str) -> None:
    """Raise unless two caches of one segment have equal shapes."""
    if a.k.shape != b.k.shape:
        raise ValueError(f"{what}: shapes differ, {tuple(a.k.shape)} vs {tuple(b.k.shape)}")


def relative_error(approx: SegmentKV, exact: SegmentKV) -> float:
    """||approx - exact||_F / ||exact||_F over keys and values together."""
    num = (approx.k.float() - exact.k.float()).square().sum() + (approx.v.float() - exact.v.float()).square().sum()
    den = exact.k.float().square().sum() + exact.v.float().square().sum()
    return float((num / den.clamp_min(1e-30)).sqrt())
