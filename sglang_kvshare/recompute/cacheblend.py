"""CacheBlend (Yao et al., 2025): token selection by KV deviation at early "check" layers.

Run time, for one shared segment of ``seg_len`` tokens in a model of ``num_layers`` layers:

1. The engine recomputes layers ``[0, check_layers)`` for ALL segment tokens (from the token
   embeddings, attending to the target's own preceding context) and keeps that KV.
2. At the last check layer ``check_layers - 1`` it measures each token's KV deviation
   ``||reused - recomputed||^2`` (K and V summed) and selects the ``num_selected(ratio, seg_len)``
   tokens with the highest deviation (HKVD tokens).
3. Only the selected tokens continue through layers ``[check_layers, num_layers)``: their hidden
   states are the outputs of the check pass, their KV is recomputed in every later layer, and their
   queries attend over the blended cache (recomputed KV for selected tokens, reused KV elsewhere).

The plan therefore recomputes ``check_layers * seg_len + k * (num_layers - check_layers)``
token-layers. The only hidden states needed are the token embeddings at layer 0. CacheBlend's
gradual narrowing of the selection across several check layers is not modelled: selection happens
once. Ratio 0 skips the check pass entirely (empty plan); ratio 1 recomputes every token in every
layer (dense prefill of the segment).
"""

from __future__ import annotations

from typing import ClassVar, Optional, Tuple

import torch

from sglang_kvshare.recompute.base import (
    KV,
    BaseSelector,
    RecomputePlan,
    SelectionInputs,
    check_ratio,
    num_selected,
    rank_desc,
    stack_kv,
    token_deviation,
)

NAME = "cacheblend"
DEFAULT_CHECK_LAYERS = 1


def select_tokens(reused_kv_layer: KV, recomputed_kv_layer: KV, ratio: float) -> torch.Tensor:
    """HKVD tokens of one check layer.

    reused_kv_layer, recomputed_kv_layer: ``[seg_len, D]`` (or ``(k, v)`` pairs). Returns int64
    ``[num_selected(ratio, seg_len)]``: indices of the tokens with the largest KV deviation, sorted
    ascending. Ties prefer the lower index.
    """
    dev = token_deviation(reused_kv_layer, recomputed_kv_layer)
    k = num_selected(ratio, dev.numel())
    return torch.sort(rank_desc(dev)[:k]).values


def plan(
    reused_kv: Optional[KV],
    recomputed_kv: Optional[KV],
    ratio: float,
    num_layers: int,
    check_layers: int = DEFAULT_CHECK_LAYERS,
    seg_len: Optional[int] = None,
) -> RecomputePlan:
    """CacheBlend plan for one segment.

    reused_kv: ``[>= check_layers, seg_len, D]`` reused cache; only layer ``check_layers - 1`` is
    read. recomputed_kv: ``[>= check_layers, seg_len, D]`` KV of the check layers recomputed for all
    tokens. Both may be None when ratio is 0 or 1 (then ``seg_len`` must be given).
    Returns mask rows ``[0, check_layers)`` all True and rows ``[check_layers, num_layers)`` True at
    the selected tokens; ``layer_groups == ((0, num_layers),)``.
    """
    ratio = check_ratio(ratio)
    if not 1 <= check_layers <= num_layers:
        raise ValueError(f"check_layers must be in [1, {num_layers}], got {check_layers}")
    if reused_kv is not None:
        found = int(stack_kv(reused_kv).shape[1])
        if seg_len is not None and seg_len != found:
            raise ValueError(f"seg_len {seg_len} disagrees with the cache ({found} tokens)")
        seg_len = found
    if seg_len is None:
        raise ValueError("seg_len is needed when no cache is given")
    if ratio == 0.0:
        return RecomputePlan.empty(NAME, num_layers, seg_len)
    if ratio == 1.0:
        return RecomputePlan.dense(NAME, num_layers, seg_len)
    if reused_kv is None or recomputed_kv is None:
        raise ValueError("cacheblend needs the reused and recomputed check-layer KV")
    a, b = stack_kv(reused_kv), stack_kv(recomputed_kv)
    if a.shape[0] < check_layers or b.shape[0] < check_layers:
        raise ValueError(f"need at least {check_layers} check layers of KV")
    layer = check_layers - 1
    idx = select_tokens(a[layer], b[layer], ratio)
    mask = torch.zeros(num_layers, seg_len, dtype=torch.bool, device=a.device)
    mask[:check_layers] = True
    mask[check_layers:, idx] = True
    return RecomputePlan(method=NAME, ratio=ratio, mask=mask, layer_groups=((0, num_layers),))


class CacheBlendSelector(BaseSelector):
    """Registry face of ``plan``; reads ``reused_kv`` and ``recomputed_kv`` (check layers)."""

    name: ClassVar[str] = NAME
    requires: ClassVar[Tuple[str, ...]] = ("reused_kv", "recomputed_kv")

    def __init__(self, check_layers: int = DEFAULT_CHECK_LAYERS) -> None:
        self.check_layers = check_layers

    def plan(self, ratio: float, inputs: SelectionInputs) -> RecomputePlan:
        if 0.0 < check_ratio(ratio) < 1.0:
            inputs.need(*self.requires)
        return plan(
            inputs.reused_kv,
            inputs.recomputed_kv,
            ratio,
            inputs.num_layers,
            check_layers=self.check_layers,
            seg_len=inputs.seg_len,
        )
