"""RelayCaching (Geng et al., 2026): tokens chosen by KV deviation and attention, recomputed only in
the critical middle layers.

Token score (``relay_scores``), for segment tokens ``t``::

    score[t] = (dev[t] / max(dev)) * (att[t] / max(att))

where ``dev[t]`` is the token's KV deviation (``token_deviation`` of reused vs recomputed KV at a
check layer, K and V summed) and ``att[t]`` is the attention mass the token receives from the
target agent's last query tokens (its private suffix), averaged over query tokens and heads
(``attention_mass``). A token scores high only when it is both wrong and read. Ties prefer the
lower index.

Layer range: ``[start, end)``, by default the middle third ``[n // 3, n - n // 3)``, or the
contiguous window of that width with the largest profiled layer deviation (``critical_layer_range``,
e.g. from ``DroidSpeakProfile.layer_deviation()``).

Budget counts token-layers: ``T = num_selected(ratio, seg_len * num_layers)``. When the range
cannot hold ``T`` (``T > width * seg_len``) it is widened one layer at a time, alternating below and
above (clamped to the model), to ``ceil(T / seg_len)`` layers. Over a range of ``W`` layers the
top ``T // W`` tokens are recomputed in every layer and the next token in the first ``T % W``
layers too, so the plan recomputes exactly ``T`` token-layers and each token's recomputed layers
are contiguous from ``start``. Hence ratio 1.0 degenerates to dense prefill (range widened to all
layers, every token) and ratio 0 to an empty plan.

Run time: the engine needs, for the selected tokens, the hidden state entering layer ``start``
(stored at the source prefill, or obtained by running those tokens through ``[0, start)`` against
the reused KV without replacing it), then recomputes their KV through the range; the other
token-layers keep the reused KV. Whatever produced ``dev`` and ``att`` (a check pass, the suffix
queries) is outside the plan's mask.
"""

from __future__ import annotations

import math
from typing import ClassVar, Optional, Tuple

import torch

from sglang_kvshare.recompute.base import (
    BaseSelector,
    RecomputePlan,
    SelectionInputs,
    check_ratio,
    num_selected,
    rank_desc,
)

NAME = "relaycaching"

LayerRange = Tuple[int, int]


def middle_third(num_layers: int) -> LayerRange:
    """``[num_layers // 3, num_layers - num_layers // 3)``; the whole model when it has < 3 layers."""
    if num_layers < 1:
        raise ValueError("num_layers must be >= 1")
    third = num_layers // 3
    return third, num_layers - third


def critical_layer_range(layer_scores: torch.Tensor, width: Optional[int] = None) -> LayerRange:
    """The contiguous window of ``width`` layers (default the middle third's width) with the largest
    summed ``layer_scores`` (1-D ``[num_layers]``); ties prefer the window nearest the middle."""
    scores = torch.as_tensor(layer_scores, dtype=torch.float64).flatten()
    n = scores.numel()
    if width is None:
        start, end = middle_third(n)
        width = end - start
    if not 1 <= width <= n:
        raise ValueError(f"width {width} outside [1, {n}]")
    sums = scores.unfold(0, width, 1).sum(dim=1)  # [n - width + 1]
    centre = (n - width) / 2.0
    best = max(range(sums.numel()), key=lambda s: (float(sums[s]), -abs(s - centre), -s))
    return best, best + width


def widen(layer_range: LayerRange, width: int, num_layers: int) -> LayerRange:
    """``layer_range`` grown to at least ``width`` layers, one layer below then one above, ...,
    clamped to ``[0, num_layers)``."""
    start, end = layer_range
    if not 0 <= start < end <= num_layers:
        raise ValueError(f"layer range {layer_range} outside [0, {num_layers})")
    width = min(width, num_layers)
    below = True
    while end - start < width:
        if (below and start > 0) or end == num_layers:
            start -= 1
        else:
            end += 1
        below = not below
    return start, end


def relay_scores(token_deviation: torch.Tensor, attention_mass: torch.Tensor) -> torch.Tensor:
    """float32 ``[seg_len]`` in [0, 1]: max-normalised deviation times max-normalised attention
    mass (both ``[seg_len]``, non-negative). A factor that is zero everywhere counts as 1."""
    dev = torch.as_tensor(token_deviation).float().flatten()
    att = torch.as_tensor(attention_mass).float().flatten().to(dev.device)
    if dev.shape != att.shape:
        raise ValueError(f"deviation {tuple(dev.shape)} and attention {tuple(att.shape)} differ")
    if bool((dev < 0).any()) or bool((att < 0).any()):
        raise ValueError("deviation and attention mass must be non-negative")

    def unit(x: torch.Tensor) -> torch.Tensor:
        top = x.max() if x.numel() else x.new_tensor(0.0)
        return x / top if float(top) > 0 else torch.ones_like(x)

    return unit(dev) * unit(att)


def attention_mass(queries: torch.Tensor, keys: torch.Tensor, scale: Optional[float] = None) -> torch.Tensor:
    """Attention mass each key position receives from the query tokens, averaged over queries and
    heads (so it sums to 1 over the keys).

    queries: ``[num_q, num_heads, head_dim]`` (e.g. the target's private suffix at one layer, RoPE
    applied); keys: ``[ctx_len, num_kv_heads, head_dim]``, all positions BEFORE the queries (no
    causal mask is applied), ``num_heads % num_kv_heads == 0`` (GQA). scale defaults to
    ``head_dim ** -0.5``. Returns float32 ``[ctx_len]``; slice the segment's positions out of it.
    """
    if queries.dim() != 3 or keys.dim() != 3 or queries.shape[-1] != keys.shape[-1]:
        raise ValueError(f"bad shapes: queries {tuple(queries.shape)}, keys {tuple(keys.shape)}")
    num_heads, num_kv_heads = queries.shape[1], keys.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads not a multiple of {num_kv_heads} kv heads")
    scale = queries.shape[-1] ** -0.5 if scale is None else scale
    k = keys.float().repeat_interleave(num_heads // num_kv_heads, dim=1)  # [ctx, H, hd]
    logits = torch.einsum("qhd,khd->hqk", queries.float(), k) * scale  # [H, num_q, ctx]
    return logits.softmax(dim=-1).mean(dim=(0, 1))


def plan(
    token_deviation: Optional[torch.Tensor],
    attention_mass: Optional[torch.Tensor],
    ratio: float,
    num_layers: int,
    layer_range: Optional[LayerRange] = None,
    seg_len: Optional[int] = None,
) -> RecomputePlan:
    """RelayCaching plan: exactly ``num_selected(ratio, seg_len * num_layers)`` token-layers.

    token_deviation, attention_mass: ``[seg_len]`` non-negative (may be None at ratio 0 and 1, then
    ``seg_len`` must be given). layer_range: ``[start, end)``, default ``middle_third``.
    ``layer_groups`` of the result is the (possibly widened) range.
    """
    ratio = check_ratio(ratio)
    if token_deviation is not None:
        found = int(torch.as_tensor(token_deviation).numel())
        if seg_len is not None and seg_len != found:
            raise ValueError(f"seg_len {seg_len} disagrees with the scores ({found} tokens)")
        seg_len = found
    if seg_len is None:
        raise ValueError("seg_len is needed when no scores are given")
    total = num_selected(ratio, seg_len * num_layers)
    if total == 0:
        return RecomputePlan(method=NAME, ratio=ratio, mask=torch.zeros(num_layers, seg_len, dtype=torch.bool))
    if ratio == 1.0 or total == seg_len * num_layers:
        return RecomputePlan.dense(NAME, num_layers, seg_len)
    if token_deviation is None or attention_mass is None:
        raise ValueError("relaycaching needs token_deviation and attention_mass")
    start, end = widen(layer_range or middle_third(num_layers), math.ceil(total / seg_len), num_layers)
    width = end - start
    per_layer, extra = divmod(total, width)
    order = rank_desc(relay_scores(token_deviation, attention_mass))
    mask = torch.zeros(num_layers, seg_len, dtype=torch.bool, device=order.device)
    mask[start:end, order[:per_layer]] = True
    if extra:
        mask[start : start + extra, order[per_layer]] = True
    return RecomputePlan(method=NAME, ratio=ratio, mask=mask, layer_groups=((start, end),))


class RelayCachingSelector(BaseSelector):
    """Registry face of ``plan``; reads ``token_deviation`` and ``attention_mass``.

    layer_scores: optional profiled per-layer deviation ``[num_layers]``; when given, the range is
    ``critical_layer_range(layer_scores, range_width)``, else the middle third (``range_width``
    then unused).
    """

    name: ClassVar[str] = NAME
    requires: ClassVar[Tuple[str, ...]] = ("token_deviation", "attention_mass")

    def __init__(self, layer_scores: Optional[torch.Tensor] = None, range_width: Optional[int] = None) -> None:
        self.layer_scores = layer_scores
        self.range_width = range_width

    def layer_range(self, num_layers: int) -> LayerRange:
        if self.layer_scores is None:
            return middle_third(num_layers)
        if int(torch.as_tensor(self.layer_scores).numel()) != num_layers:
            raise ValueError("layer_scores length differs from num_layers")
        return critical_layer_range(self.layer_scores, self.range_width)

    def plan(self, ratio: float, inputs: SelectionInputs) -> RecomputePlan:
        if 0.0 < check_ratio(ratio) < 1.0:
            inputs.need(*self.requires)
        return plan(
            inputs.token_deviation,
            inputs.attention_mass,
            ratio,
            inputs.num_layers,
            layer_range=self.layer_range(inputs.num_layers),
            seg_len=inputs.seg_len,
        )
