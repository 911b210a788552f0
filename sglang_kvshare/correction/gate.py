"""Anchor matching math shared by the online-anchor methods (KVCMAS appendix A.3, KVComm).

All functions are pure: they read their inputs and return new tensors.
"""

from __future__ import annotations

import math
from typing import Tuple

import torch


def relative_distances(distances: torch.Tensor) -> torch.Tensor:
    """d_v / min_u d_u: scale-free gate distances (1 for the nearest anchor).

    Eq. 9's raw distances grow with sqrt(segment rows x layers x D), so softmax(-d / T) is one-hot
    on any segment of realistic length and the entropy gate accepts every correction. Relative to
    the nearest anchor they measure how distinct that anchor is (an anchor 10 % farther than the
    nearest one gets d = 1.1), whatever the segment's length and the model's value scale.
    A zero distance (an exact match) counts as 1e-12 of the largest one.
    """
    d = distances.double()
    floor = torch.clamp(d.max() * 1e-12, min=torch.finfo(torch.float64).tiny)
    return d / torch.clamp(d.min(), min=floor)


def gate_weights(distances: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """g_v = softmax(-d_v / T) over anchors (eq. 10). distances: [N] -> [N] float64."""
    return torch.softmax(-distances.double() / temperature, dim=0)


def normalized_entropy(g: torch.Tensor) -> float:
    """-sum g log2 g / log2 N (eq. 11), in [0, 1]. g: [N] probabilities, N >= 2; 0 log 0 = 0."""
    n = g.numel()
    if n < 2:
        raise ValueError("normalised entropy needs at least two anchors")
    g = g.double()
    h = -(torch.where(g > 0, g * torch.log2(g), torch.zeros_like(g))).sum()
    return float(h) / math.log2(n)


def gate(distances: torch.Tensor, temperature: float = 1.0) -> Tuple[torch.Tensor, float]:
    """(g, normalised entropy) for gate distances [N]."""
    g = gate_weights(distances, temperature)
    return g, normalized_entropy(g)


def token_weights(distances: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Token-wise interpolation weights: softmax over anchors of -d[v, t] / T.

    distances: [N, T] distance of each token to each anchor (the paper: mean absolute; the
    online correctors pass the root mean square, ``online`` step 5) -> [N, T] float32, each
    column sums to 1.
    """
    return torch.softmax(-distances.float() / temperature, dim=0)
