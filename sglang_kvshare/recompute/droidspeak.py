"""DroidSpeak (Liu et al., 2026): recompute the whole segment in profiled critical layer groups.

Offline, ``DroidSpeakProfile`` accumulates the layer-wise KV deviation between reused and exact
caches over profiling samples. ``choose_groups`` then picks at most ``max_groups`` disjoint
CONTIGUOUS layer ranges with ``num_selected(ratio, num_layers)`` layers in total that maximise the
summed profiled deviation (exact dynamic programme; on ties, fewer groups).

Run time: for every group ``[start, end)`` the engine feeds ALL segment tokens' hidden states
entering layer ``start`` (stored when the source agent prefilled the segment; the embeddings when
``start == 0``) through layers ``start .. end - 1`` under the target's context, and replaces the
segment KV of those layers; the other layers keep the reused KV. Each group costs one stored
hidden state ``[seg_len, hidden_size]`` per segment, hence the small default ``max_groups``.
Ratio 0 is an empty plan; ratio 1 is one group ``[0, num_layers)``, i.e. dense prefill.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import ClassVar, Dict, List, Optional, Sequence, Tuple

import torch

from sglang_kvshare.recompute.base import (
    KV,
    BaseSelector,
    RecomputePlan,
    SelectionInputs,
    check_ratio,
    entry_deviation,
    num_selected,
    stack_kv,
)

NAME = "droidspeak"
DEFAULT_MAX_GROUPS = 2

LayerGroups = Tuple[Tuple[int, int], ...]


def best_layer_groups(scores: Sequence[float], num_layers_budget: int, max_groups: int) -> LayerGroups:
    """At most ``max_groups`` disjoint contiguous ``[start, end)`` ranges covering exactly
    ``num_layers_budget`` layers with maximal summed ``scores`` (1-D, one per layer). Among equal
    sums the fewest groups win. Returned in ascending order; empty for a zero budget.
    """
    scores = [float(s) for s in scores]
    n = len(scores)
    budget = int(num_layers_budget)
    if not 0 <= budget <= n:
        raise ValueError(f"layer budget {budget} outside [0, {n}]")
    if budget == 0:
        return ()
    if max_groups < 1:
        raise ValueError(f"max_groups must be >= 1, got {max_groups}")
    groups_cap = min(max_groups, budget)
    neg = -math.inf
    # best[b][g][s]: max score over the layers seen so far with b chosen layers in g groups,
    # s = 1 when the last seen layer is chosen. parents[i] holds the predecessor state per state.
    shape = (budget + 1, groups_cap + 1, 2)
    best = [[[neg, neg] for _ in range(shape[1])] for _ in range(shape[0])]
    best[0][0][0] = 0.0
    parents: List[Dict[Tuple[int, int, int], Tuple[int, int, int]]] = []
    for i in range(n):
        nxt = [[[neg, neg] for _ in range(shape[1])] for _ in range(shape[0])]
        par: Dict[Tuple[int, int, int], Tuple[int, int, int]] = {}

        def relax(state, value, prev):
            b, g, s = state
            if value > nxt[b][g][s]:
                nxt[b][g][s] = value
                par[state] = prev

        for b in range(budget + 1):
            for g in range(groups_cap + 1):
                for s in (0, 1):
                    v = best[b][g][s]
                    if v == neg:
                        continue
                    relax((b, g, 0), v, (b, g, s))
                    if b < budget:
                        if s == 1:
                            relax((b + 1, g, 1), v + scores[i], (b, g, s))
                        elif g < groups_cap:
                            relax((b + 1, g + 1, 1), v + scores[i], (b, g, s))
        best = nxt
        parents.append(par)
    end_state, end_value = None, neg
    for g in range(1, groups_cap + 1):
        for s in (0, 1):
            if best[budget][g][s] > end_value:
                end_state, end_value = (budget, g, s), best[budget][g][s]
    assert end_state is not None
    chosen = [False] * n
    state = end_state
    for i in range(n - 1, -1, -1):
        chosen[i] = state[2] == 1
        state = parents[i][state]
    groups: List[Tuple[int, int]] = []
    for i, c in enumerate(chosen):
        if c and (i == 0 or not chosen[i - 1]):
            groups.append((i, i + 1))
        elif c:
            groups[-1] = (groups[-1][0], i + 1)
    return tuple(groups)


def plan_from_groups(groups: LayerGroups, num_layers: int, seg_len: int, ratio: float) -> RecomputePlan:
    """Mask with rows of every layer in ``groups`` all True (all tokens recomputed there)."""
    mask = torch.zeros(num_layers, seg_len, dtype=torch.bool)
    for start, end in groups:
        if not 0 <= start < end <= num_layers:
            raise ValueError(f"layer group {(start, end)} outside [0, {num_layers})")
        mask[start:end] = True
    return RecomputePlan(method=NAME, ratio=check_ratio(ratio), mask=mask, layer_groups=tuple(groups))


class DroidSpeakProfile:
    """Offline layer-wise KV deviation profile.

    Per sample, the deviation of layer ``l`` is ``||reused_l - exact_l||_F^2`` summed over tokens and
    K/V features, divided by ``||exact_l||_F^2`` when ``relative`` (scale-free across layers; the
    default) and by ``seg_len`` otherwise (mean per token). ``layer_deviation`` is the mean over
    samples, so every sample weighs the same whatever its length. Mutated only by ``accumulate``.
    """

    def __init__(self, num_layers: int, relative: bool = True) -> None:
        self.num_layers = int(num_layers)
        self.relative = bool(relative)
        self.sum = torch.zeros(self.num_layers, dtype=torch.float64)
        self.num_samples = 0

    def accumulate(self, reused: KV, exact: KV) -> None:
        """Add one sample: reused, exact ``[num_layers, seg_len, D]`` (or ``(k, v)`` pairs)."""
        err = entry_deviation(reused, exact).double()  # [num_layers, seg_len]
        if err.shape[0] != self.num_layers:
            raise ValueError(f"expected {self.num_layers} layers, got {err.shape[0]}")
        per_layer = err.sum(dim=1)
        if self.relative:
            ref = stack_kv(exact).double().pow(2).sum(dim=(1, 2))
            per_layer = per_layer / ref.clamp_min(torch.finfo(torch.float64).tiny)
        else:
            per_layer = per_layer / max(int(err.shape[1]), 1)
        self.sum += per_layer.cpu()
        self.num_samples += 1

    def layer_deviation(self) -> torch.Tensor:
        """float64 ``[num_layers]``: mean profiled deviation per layer."""
        if self.num_samples == 0:
            raise ValueError("empty profile: accumulate samples first")
        return self.sum / self.num_samples

    def choose_groups(self, ratio: float, max_groups: int = DEFAULT_MAX_GROUPS) -> LayerGroups:
        """Critical contiguous layer groups with ``num_selected(ratio, num_layers)`` layers total."""
        budget = num_selected(ratio, self.num_layers)
        if budget in (0, self.num_layers):
            return () if budget == 0 else ((0, self.num_layers),)
        return best_layer_groups(self.layer_deviation().tolist(), budget, max_groups)

    def plan(self, ratio: float, seg_len: int, max_groups: int = DEFAULT_MAX_GROUPS) -> RecomputePlan:
        """All ``seg_len`` tokens recomputed in the layers of ``choose_groups(ratio, max_groups)``."""
        groups = self.choose_groups(ratio, max_groups)
        return plan_from_groups(groups, self.num_layers, seg_len, ratio)

    def state_dict(self) -> Dict[str, object]:
        return {
            "num_layers": self.num_layers,
            "relative": self.relative,
            "sum": self.sum.clone(),
            "num_samples": self.num_samples,
        }

    @classmethod
    def from_state_dict(cls, state: Dict[str, object]) -> "DroidSpeakProfile":
        prof = cls(int(state["num_layers"]), relative=bool(state["relative"]))
        prof.sum = torch.as_tensor(state["sum"], dtype=torch.float64).clone()
        prof.num_samples = int(state["num_samples"])
        return prof

    @classmethod
    def of_layer_deviation(cls, layer_deviation: Sequence[float]) -> "DroidSpeakProfile":
        """A profile whose mean layer deviation is ``layer_deviation``."""
        dev = [float(x) for x in layer_deviation]
        return cls.from_state_dict({"num_layers": len(dev), "relative": True, "sum": dev, "num_samples": 1})

    @classmethod
    def load(cls, path: str, num_layers: int) -> "DroidSpeakProfile":
        """A profile JSON written by ``benchmarks.coverage`` (``{"layer_deviation": [...]}``)."""
        prof = cls.of_layer_deviation(json.loads(Path(path).read_text())["layer_deviation"])
        if prof.num_layers != num_layers:
            raise ValueError(f"DroidSpeak profile {path} has {prof.num_layers} layers, the model has {num_layers}")
        return prof


class DroidSpeakSelector(BaseSelector):
    """Registry face: a fixed profile, no run-time inputs (the choice is per ratio, not per request)."""

    name: ClassVar[str] = NAME
    requires: ClassVar[Tuple[str, ...]] = ()

    def __init__(self, profile: Optional[DroidSpeakProfile] = None, max_groups: int = DEFAULT_MAX_GROUPS) -> None:
        self.profile = profile
        self.max_groups = max_groups

    def plan(self, ratio: float, inputs: SelectionInputs) -> RecomputePlan:
        ratio = check_ratio(ratio)
        if ratio == 0.0:
            return RecomputePlan.empty(NAME, inputs.num_layers, inputs.seg_len)
        if ratio == 1.0:
            return RecomputePlan.dense(NAME, inputs.num_layers, inputs.seg_len)
        if self.profile is None:
            raise ValueError("droidspeak needs an offline DroidSpeakProfile")
        if self.profile.num_layers != inputs.num_layers:
            raise ValueError(f"profile has {self.profile.num_layers} layers, model has {inputs.num_layers}")
        return self.profile.plan(ratio, inputs.seg_len, self.max_groups)
