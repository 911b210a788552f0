"""Selective recomputation baselines (KVCMAS Sec. 2.2 and App. A.1; PReCache Sec. 4.1).

Plain torch, no sglang: each rule turns a budget ``ratio`` (rho = 1 - ratio) and its inputs into a
``RecomputePlan`` (bool ``[num_layers, seg_len]``: which token-layers the engine recomputes).

- ``cacheblend``: recompute the check layers for all tokens, then the top-deviation tokens through
  the remaining layers.
- ``droidspeak``: recompute all tokens in profiled critical contiguous layer groups.
- ``relaycaching``: recompute deviation x attention tokens in the critical middle layers.
- ``random``: the same budget at random (coverage reference).

``coverage`` / ``relative_coverage`` measure how much reuse error a mask removes.
"""

from typing import Dict, Type

from sglang_kvshare.recompute.base import (
    KV,
    BaseSelector,
    RecomputePlan,
    SelectionInputs,
    compose,
    entry_deviation,
    num_selected,
    token_deviation,
)
from sglang_kvshare.recompute.cacheblend import CacheBlendSelector
from sglang_kvshare.recompute.coverage import coverage, coverage_of_errors, relative_coverage
from sglang_kvshare.recompute.droidspeak import DroidSpeakProfile, DroidSpeakSelector
from sglang_kvshare.recompute.random import RandomSelector, random_mask, random_mask_like
from sglang_kvshare.recompute.relaycaching import RelayCachingSelector, attention_mass, middle_third, relay_scores

SELECTORS: Dict[str, Type[BaseSelector]] = {
    cls.name: cls for cls in (CacheBlendSelector, DroidSpeakSelector, RelayCachingSelector, RandomSelector)
}


def get_selector(name: str, **kwargs) -> BaseSelector:
    """A new selector registered as ``name`` (one of ``SELECTORS``), built with ``kwargs``
    (e.g. ``check_layers=1``, ``profile=...``, ``layer_scores=...``, ``seed=0``)."""
    try:
        cls = SELECTORS[name]
    except KeyError:
        raise ValueError(f"unknown selector {name!r}; choose from {sorted(SELECTORS)}") from None
    return cls(**kwargs)


__all__ = [
    "KV",
    "BaseSelector",
    "CacheBlendSelector",
    "DroidSpeakProfile",
    "DroidSpeakSelector",
    "RandomSelector",
    "RecomputePlan",
    "RelayCachingSelector",
    "SELECTORS",
    "SelectionInputs",
    "attention_mass",
    "compose",
    "coverage",
    "coverage_of_errors",
    "entry_deviation",
    "get_selector",
    "middle_third",
    "num_selected",
    "random_mask",
    "random_mask_like",
    "relative_coverage",
    "relay_scores",
    "token_deviation",
]
