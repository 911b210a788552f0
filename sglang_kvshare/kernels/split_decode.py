"""Decode attention over a token-indexed KV pool without gathering the long runs of slots (CPU).

SGLang's torch-native decode gathers each request's K and V rows (``k_cache[slots]``) every layer
and step: at 2K tokens of context that is a ~3 MB copy per request and layer, most of the decode
step on the CPU. A request's slots are mostly a few long contiguous runs (a prefix, an injected or
prefilled segment), so those are attended as views of the pool, the scattered rest (decode
tokens, short pieces) is gathered, and the partial results are merged by their log-sum-exp
(split-KV attention). With grouped-query attention the G query heads of a KV head become G query
rows of that head (a decode query sees every key, so no mask is involved).

Plain torch; ``torch.ops.aten._scaled_dot_product_flash_attention_for_cpu`` gives each part's
output and log-sum-exp.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

MIN_RUN = 128  # shorter runs are gathered with the rest (a view saves little, a call costs some)


class SlotRuns(NamedTuple):
    """A request's KV slots as (first slot, length) runs attended in place, and the other slots."""

    runs: list
    rest: Optional[torch.Tensor]


def slot_runs(slots: torch.Tensor, min_run: int = MIN_RUN) -> SlotRuns:
    """Split ``slots`` [n] (int) into contiguous ascending runs of >= ``min_run`` slots and the rest."""
    n = slots.numel()
    if n == 0:
        return SlotRuns([], None)
    breaks = (torch.nonzero(slots[1:] - slots[:-1] != 1).flatten() + 1).tolist()
    bounds = [0, *breaks, n]
    runs, rest = [], []
    for a, b in zip(bounds[:-1], bounds[1:]):
        if b - a >= min_run:
            runs.append((int(slots[a]), b - a))
        else:
            rest.append(slots[a:b])
    return SlotRuns(runs, torch.cat(rest) if rest else None)


def split_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, parts: SlotRuns, scale: float
) -> torch.Tensor:
    """Attention of one decode query q [Hq, D] over the slots of ``parts`` in k_cache / v_cache
    [rows, Hkv, D] (Hq a multiple of Hkv): [Hq, Dv], equal to SDPA over the gathered slots."""
    outs, lses = decode_pieces(q, k_cache, v_cache, parts, scale)
    return merge_pieces(outs, lses, q.dtype).reshape(q.shape[0], -1)


def decode_pieces(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, parts: SlotRuns, scale: float):
    """(outputs, log-sum-exps) of q [Hq, D] over each run of ``parts`` and over its gathered rest,
    each [1, Hkv, Hq / Hkv, Dv] and [1, Hkv, Hq / Hkv], for ``merge_pieces``."""
    Hq, D = q.shape
    Hkv = k_cache.shape[1]
    qg = q.view(1, Hkv, Hq // Hkv, D)  # KV head h's query heads as rows
    pieces = [(k_cache[s : s + n], v_cache[s : s + n]) for s, n in parts.runs]
    if parts.rest is not None:
        pieces.append((k_cache[parts.rest], v_cache[parts.rest]))
    outs, lses = [], []
    for k, v in pieces:
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            qg, k.movedim(0, 1).unsqueeze(0), v.movedim(0, 1).unsqueeze(0), scale=scale
        )[:2]
        outs.append(o)
        lses.append(lse)
    return outs, lses


def merge_pieces(outs: list, lses: list, dtype: torch.dtype) -> torch.Tensor:
    """Attention over the union of the pieces' keys from each piece's output [..., Dv] and
    log-sum-exp [...] (softmax over the log-sum-exps); a piece whose keys a row may not see
    (log-sum-exp -inf) has weight 0 there."""
    if len(outs) == 1:
        return outs[0]
    w = torch.softmax(torch.stack(lses).float(), dim=0).unsqueeze(-1)  # [P, ..., 1]
    return (torch.stack(outs).float().nan_to_num() * w).sum(0).to(dtype)
