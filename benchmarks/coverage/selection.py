"""The coverage benchmark's recompute selections (``layer_mask``, ``token_mask``), the coverage of
one selection against random selection (``coverage_entry``) and its summary over segments, as
typed records written to the results JSON with the keys of earlier runs."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Dict, Mapping, Optional, Sequence, Union

from benchmarks.fidelity_metrics import mean
from sglang_kvshare.recompute import DroidSpeakProfile, coverage_of_errors, num_selected, random_mask_like
from sglang_kvshare.recompute.coverage import DEFAULT_SEEDS

RHOS = (0.9, 0.8)
CRITERIA = ("layer", "deviation", "attention")
CHECK_LAYER = 1
MAX_GROUPS = 2


def layer_mask(profile: DroidSpeakProfile, ratio: float, seg_len: int):
    return profile.plan(ratio, seg_len, MAX_GROUPS).mask


def token_mask(scores, ratio: float, num_layers: int):
    """Every layer of the ``ratio`` share of tokens with the largest ``scores``."""
    import torch

    k = num_selected(ratio, scores.numel())
    mask = torch.zeros(num_layers, scores.numel(), dtype=torch.bool)
    mask[:, torch.argsort(scores, descending=True, stable=True)[:k]] = True
    return mask


@dataclass(frozen=True)
class CoverageEntry:
    """One selection on one segment: the fraction of the reuse error ``err2`` (``||E||_F^2``) it
    removes (``removed2``), that of random selections of the same size, and their ratio."""

    coverage: float
    random: float
    relative: float
    err2: float
    removed2: float

    def to_json(self) -> Dict[str, float]:
        return asdict(self)


def coverage_entry(errors, mask) -> CoverageEntry:
    cov = coverage_of_errors(errors, mask)
    rnd = mean(coverage_of_errors(errors, random_mask_like(mask, s)) for s in DEFAULT_SEEDS)
    return CoverageEntry(cov, rnd, cov / rnd if rnd else float("nan"), float(errors.sum()), float(errors[mask].sum()))


ByRho = Mapping[float, Mapping[str, Any]]


def _by_rho_json(by_rho: ByRho) -> Dict[str, Dict[str, Any]]:
    return {str(rho): {c: e.to_json() for c, e in row.items()} for rho, row in by_rho.items()}


@dataclass(frozen=True)
class SegmentCoverage:
    """A reused segment of a later agent: its relative reuse error and, per rho, each criterion's
    :class:`CoverageEntry` at the budget ``1 - rho``."""

    task_id: str
    agent: str
    slot: str
    tokens: int
    rel_err: float
    by_rho: Mapping[float, Mapping[str, CoverageEntry]]

    def to_json(self) -> Dict[str, Any]:
        head = {k: getattr(self, k) for k in ("task_id", "agent", "slot", "tokens", "rel_err")}
        return {**head, **_by_rho_json(self.by_rho)}


@dataclass(frozen=True)
class MismatchedSegment:
    """A segment whose prompt ids (transformers' tokenisation) differ from the dumped ones."""

    task_id: str
    agent: str
    slot: str

    def to_json(self) -> Dict[str, Any]:
        return {**asdict(self), "mismatch": True}


SegmentResult = Union[SegmentCoverage, MismatchedSegment]


@dataclass(frozen=True)
class CriterionSummary:
    """A criterion's coverage over segments: means of the per-segment values, and the removed
    share of the summed error (``coverage_pooled``; None without error)."""

    coverage_mean: Optional[float]
    random_mean: Optional[float]
    relative_mean: Optional[float]
    coverage_pooled: Optional[float]

    def to_json(self) -> Dict[str, Optional[float]]:
        return asdict(self)


@dataclass(frozen=True)
class CoverageSummary:
    """The ``coverage`` section: segments compared, mismatched ones, and per rho each criterion's
    :class:`CriterionSummary`."""

    segments: int
    mismatched: int
    by_rho: Mapping[float, Mapping[str, CriterionSummary]]

    def to_json(self) -> Dict[str, Any]:
        return {"segments": self.segments, "mismatched": self.mismatched, **_by_rho_json(self.by_rho)}


def summarise_coverage(pairs: Sequence[SegmentResult]) -> CoverageSummary:
    ok = [p for p in pairs if isinstance(p, SegmentCoverage)]
    by_rho = {}
    for rho in RHOS:
        row = {}
        for c in CRITERIA:
            es = [p.by_rho[rho][c] for p in ok]
            removed, total = sum(e.removed2 for e in es), sum(e.err2 for e in es)
            row[c] = CriterionSummary(
                coverage_mean=mean(e.coverage for e in es),
                random_mean=mean(e.random for e in es),
                relative_mean=mean(e.relative for e in es),
                coverage_pooled=removed / total if total else None,
            )
        by_rho[rho] = row
    return CoverageSummary(len(ok), len(pairs) - len(ok), by_rho)
