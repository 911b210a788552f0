"""Reconstruction coverage of selective recomputation (KVCMAS App. A.1).

The reuse error of a segment is ``E = reused - exact`` over all layers, tokens and K/V features.
Coverage of a mask is the fraction of the total SQUARED Frobenius norm of ``E`` (summed over every
layer, token and feature, K and V together when pairs are given) that disappears when the masked
token-layers are replaced by their exact KV (Eq. 3 with a perfect recomputation)::

    coverage = sum_{(l,t) in mask} ||E[l, t]||^2 / sum_{(l,t)} ||E[l, t]||^2

The paper's normalisation by ``||exact||_F`` cancels in this ratio. Squared norms make coverage
additive over entries, so random selection of a fraction f of the entries has expected coverage f.
Relative coverage divides by the mean coverage of random masks with the same number of entries.
"""

from __future__ import annotations

from typing import Sequence

import torch

from sglang_kvshare.recompute.base import KV, entry_deviation
from sglang_kvshare.recompute.random import random_mask_like

DEFAULT_SEEDS = (0, 1, 2, 3, 4)


def coverage_of_errors(errors: torch.Tensor, mask: torch.Tensor) -> float:
    """Coverage from precomputed per-entry squared errors ``[num_layers, seg_len]`` (see
    ``entry_deviation``) and a bool mask of the same shape. 1.0 when the total error is 0."""
    if tuple(errors.shape) != tuple(mask.shape) or mask.dtype != torch.bool:
        raise ValueError(f"errors {tuple(errors.shape)} and bool mask {tuple(mask.shape)} needed")
    errors = errors.double()
    total = float(errors.sum())
    if total == 0.0:
        return 1.0
    return float(errors[mask.to(errors.device)].sum()) / total


def coverage(reused: KV, exact: KV, mask: torch.Tensor) -> float:
    """Fraction of the squared-Frobenius reuse error removed by recomputing ``mask`` exactly.

    reused, exact: ``[num_layers, seg_len, D]`` (or ``(k, v)`` pairs); mask: bool
    ``[num_layers, seg_len]``. In [0, 1]; 1.0 for a full mask or when reused == exact, 0.0 for an
    empty mask with nonzero error.
    """
    return coverage_of_errors(entry_deviation(reused, exact), mask)


def relative_coverage(reused: KV, exact: KV, mask: torch.Tensor, seeds: Sequence[int] = DEFAULT_SEEDS) -> float:
    """``coverage(mask)`` divided by the mean coverage of ``random_mask_like(mask, seed)`` over
    ``seeds`` (same number of token-layers). NaN when that mean is 0 (e.g. an empty mask)."""
    errors = entry_deviation(reused, exact)
    ref = sum(coverage_of_errors(errors, random_mask_like(mask, s)) for s in seeds) / len(seeds)
    if ref == 0.0:
        return float("nan")
    return coverage_of_errors(errors, mask) / ref
