"""Random selection at a given budget: the reference of the coverage analysis (KVCMAS App. A.1).

Units of the budget ``num_selected(ratio, n)``:

- ``"tokens"``: ``n = seg_len`` random tokens, recomputed in every layer;
- ``"layers"``: ``n = num_layers`` random layers, every token recomputed there;
- ``"token_layers"``: ``n = num_layers * seg_len`` random (layer, token) entries.

Each entry is selected with the same marginal probability in every unit, so the expected coverage
is the same; the units differ only in variance. Seeded with a private ``torch.Generator``: the same
seed gives the same mask on every machine, and global RNG state is untouched.
"""

from __future__ import annotations

from typing import ClassVar, Tuple

import torch

from sglang_kvshare.recompute.base import BaseSelector, RecomputePlan, SelectionInputs, num_selected

NAME = "random"
UNITS = ("tokens", "layers", "token_layers")


def _pick(n: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(int(seed))
    return torch.randperm(n, generator=gen)[:k]


def random_mask(num_layers: int, seg_len: int, ratio: float, unit: str = "token_layers", seed: int = 0) -> torch.Tensor:
    """bool ``[num_layers, seg_len]`` CPU mask with ``num_selected(ratio, n)`` units chosen
    uniformly without replacement (see the module docstring for ``unit``)."""
    mask = torch.zeros(num_layers, seg_len, dtype=torch.bool)
    if unit == "tokens":
        mask[:, _pick(seg_len, num_selected(ratio, seg_len), seed)] = True
    elif unit == "layers":
        mask[_pick(num_layers, num_selected(ratio, num_layers), seed)] = True
    elif unit == "token_layers":
        n = num_layers * seg_len
        mask.view(-1)[_pick(n, num_selected(ratio, n), seed)] = True
    else:
        raise ValueError(f"unit must be one of {UNITS}, got {unit!r}")
    return mask


def random_mask_like(mask: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """bool mask of ``mask``'s shape and device with the same number of True entries, placed
    uniformly at random (token-layer unit)."""
    out = torch.zeros(mask.numel(), dtype=torch.bool)
    out[_pick(mask.numel(), int(mask.sum().item()), seed)] = True
    return out.view(mask.shape).to(mask.device)


def plan(num_layers: int, seg_len: int, ratio: float, unit: str = "token_layers", seed: int = 0) -> RecomputePlan:
    """Random plan; ``layer_groups`` is empty (no structure the engine could exploit)."""
    mask = random_mask(num_layers, seg_len, ratio, unit=unit, seed=seed)
    return RecomputePlan(method=NAME, ratio=float(ratio), mask=mask)


class RandomSelector(BaseSelector):
    """Registry face of ``plan``; no run-time inputs."""

    name: ClassVar[str] = NAME
    requires: ClassVar[Tuple[str, ...]] = ()

    def __init__(self, unit: str = "token_layers", seed: int = 0) -> None:
        if unit not in UNITS:
            raise ValueError(f"unit must be one of {UNITS}, got {unit!r}")
        self.unit = unit
        self.seed = seed

    def plan(self, ratio: float, inputs: SelectionInputs) -> RecomputePlan:
        return plan(inputs.num_layers, inputs.seg_len, ratio, unit=self.unit, seed=self.seed)
