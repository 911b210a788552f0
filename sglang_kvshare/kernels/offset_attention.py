"""Attention over KV slots that carry RoPE at other positions than the request reads them at.

A KV view (one copy of a shared context): a later agent reads a shared span in the source's
slots in place, where the keys carry RoPE at the source's positions n' = n - d rather than at
the request's n. RoPE is relative, so a query at position m, turned back by d, scores a cached
key as the re-rotated copy would:  (R_{m-d} q) . (R_{n-d} k) = (R_m q) . (R_n k).
The request's keys fall into groups of one shift d each (0 for its own slots); each group is
attended with its own turned query, and the groups are merged by their log-sum-exp (split-KV
attention, as ``kernels.split_decode``). Plain torch, the reference of a GPU kernel.

- ``offset_decode_attention``: one decode query over (``SlotRuns``, shift) parts.
- ``offset_extend_attention``: an extend's queries over gathered keys with a per-key shift and
  the causal mask by the request's positions.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

from sglang_kvshare.kernels.split_decode import SlotRuns, decode_pieces, merge_pieces
from sglang_kvshare.rope.align import RopeSpec, shift_keys


def turn(q: torch.Tensor, shift: int, rope: RopeSpec) -> torch.Tensor:
    """Queries [T, H, D] (or one [H, D]) turned by ``shift`` positions (RoPE), same shape."""
    if shift == 0:
        return q
    if q.dim() == 2:
        return shift_keys(q.unsqueeze(0), shift, rope)[0]
    return shift_keys(q, shift, rope)


def offset_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, parts: Sequence[Tuple[SlotRuns, int]],
    scale: float, rope: RopeSpec,
) -> torch.Tensor:
    """One decode query q [Hq, D] over ``parts``, each (slots, shift d: the request reads those
    slots d positions later than their keys were rotated for): [Hq, Dv], equal to SDPA over the
    gathered slots with each part's keys turned by +d."""
    outs: List[torch.Tensor] = []
    lses: List[torch.Tensor] = []
    for runs, shift in parts:
        o, lse = decode_pieces(turn(q, -shift, rope), k_cache, v_cache, runs, scale)
        outs += o
        lses += lse
    return merge_pieces(outs, lses, q.dtype).reshape(q.shape[0], -1)


def offset_extend_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shifts: torch.Tensor, q_pos: torch.Tensor,
    scale: float, rope: RopeSpec,
) -> torch.Tensor:
    """Causal attention of an extend's queries q [T, Hq, D] (at the request's positions
    ``q_pos`` [T]) over a request's gathered keys and values k, v [kv, Hkv, D] (key i at the
    request's position i, its RoPE ``shifts[i]`` positions earlier): [T, Hq, Dv], equal to SDPA
    over the keys turned by +shifts[i] under the mask key position <= query position."""
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    k_pos = torch.arange(k.shape[0], device=q.device)
    outs, lses = [], []
    for shift in torch.unique(shifts).tolist():
        sel = torch.nonzero(shifts == shift).flatten()
        qs = turn(q, -int(shift), rope)
        # KV head h's query heads as rows (t, g) of that head; the mask row repeats per g
        qg = qs.view(T, Hkv, G, D).permute(1, 0, 2, 3).reshape(1, Hkv, T * G, D)
        seen = (k_pos[sel][None, :] <= q_pos[:, None]).repeat_interleave(G, 0)  # [T * G, n]
        mask = torch.zeros(seen.shape, dtype=q.dtype, device=q.device).masked_fill_(~seen, float("-inf"))
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            qg, k[sel].movedim(0, 1).unsqueeze(0), v[sel].movedim(0, 1).unsqueeze(0),
            attn_mask=mask, scale=scale,
        )[:2]
        outs.append(o)
        lses.append(lse.masked_fill(~seen.any(-1), float("-inf")))  # the kernel gives 0 for a row that sees no key
    out = merge_pieces(outs, lses, q.dtype)  # [1, Hkv, T * G, Dv]
    return out.view(Hkv, T, G, -1).permute(1, 0, 2, 3).reshape(T, Hq, -1)
