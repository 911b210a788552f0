"""Attention over KV slots that carry RoPE at other positions than the request reads them at.

A KV view (one copy of a shared context): a later agent reads a shared span in the source's
slots in place, where the keys carry RoPE at the source's positions n' = n - d rather than at
the request's n. RoPE is relative, so a query at position m, turned back by d, scores a cached
key as the re-rotated copy would:  (R_{m-d} q) . (R_{n-d} k) = (R_m q) . (R_n k).

A request's keys are planned once per forward (``key_plan``), as ``split_decode`` plans its
runs: long contiguous runs of one shift are attended in the pool with the query turned back by
the shift (no gather, no per-key work), and the other keys (short spans, decode tokens) are
gathered and each turned forward by its own shift, so they cost one attention call together.
The pieces are merged by their log-sum-exp (split-KV attention). Plain torch, the reference of
a GPU kernel (the Triton kernel turns each key as it loads it, ``flash_lora_attention``).

KV leaves (``kernels.kv_leaf``): keys and values read as the cached ones plus a low-rank
correction; a long run with a leaf is still attended in place (``leaf_run``), short leaf spans
are gathered with the rest and corrected before they are turned.

- ``offset_decode_attention``: one decode query over a ``KeyPlan``.
- ``offset_extend_attention``: an extend's queries over a request's slots: the keys before the
  first query (every query sees them) by their plan, the rest gathered, causally (an extend) or
  under a mask by position (rows chosen for recomputation). Requests without views use it too
  when keys precede their queries (shifts 0: runs attended in place, no turn): SDPA's mask
  over a prefix makes the CPU kernel compute every key block, twice the work of a causal extend.
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Tuple

import torch

from sglang_kvshare.kernels.kv_leaf import FLASH, KeyLeaf, leaf_part, leaf_run, with_leaf
from sglang_kvshare.kernels.split_decode import MIN_RUN, merge_pieces
from sglang_kvshare.rope.align import RopeSpec, rotate


class KeyPlan(NamedTuple):
    """A request's keys for attention in place: ``runs`` (first slot, length, shift), each
    contiguous and of one shift, and ``q_turn``: per shift of a run, the [D, D] matrix that
    turns a query back by it (``x @ M``: one small matmul; built at the first use, kept for the
    other layers); ``rest``: the other slots (gathered) and ``rest_turn``:
    (cos, sin) [len(rest), rotary_dim // 2] turning each of them forward by its shift (None:
    none is shifted); ``rest_leaf``: the rest's rows that carry a KV leaf (``leaf_part``)."""

    runs: list
    q_turn: dict
    rest: Optional[torch.Tensor]
    rest_turn: Optional[Tuple[torch.Tensor, torch.Tensor]]
    rest_leaf: Optional[tuple] = None


def _turn_tables(shifts: torch.Tensor, rope: RopeSpec) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    if not bool(shifts.any()):
        return None
    ang = shifts.to(torch.float64)[:, None] * rope.inv_freq.to(torch.float64)[None, :]  # float64, as shift_keys
    return ang.cos().float().to(shifts.device), ang.sin().float().to(shifts.device)


def _turned(k: torch.Tensor, tables, rope: RopeSpec) -> torch.Tensor:
    """Gathered keys k [n, H, D] each turned by its row of ``tables`` (None: unchanged)."""
    if tables is None:
        return k
    turned = rotate(k, *tables, rope).to(k.dtype)
    return turned if rope.rotary_dim == k.shape[-1] else torch.cat((turned, k[..., rope.rotary_dim :]), dim=-1)


def _turn_matrix(shift: int, D: int, rope: RopeSpec, device) -> torch.Tensor:
    """M [D, D] float32 with ``x @ M`` = x [.., D] turned by ``shift`` positions (the identity's rows turned)."""
    eye = torch.eye(D, device=device).unsqueeze(1)  # [D, 1, D]: D rows of one head
    return _turned(eye, _turn_tables(torch.full((D,), shift, device=device), rope), rope)[:, 0, :]


def key_plan(
    slots: torch.Tensor,
    shifts: torch.Tensor,
    rope: RopeSpec,
    min_run: int = MIN_RUN,
    leaf: Optional[KeyLeaf] = None,
    rows_of: Optional[torch.Tensor] = None,
) -> KeyPlan:
    """Plan the keys in ``slots`` [n] (int) whose RoPE is ``shifts`` [n] positions earlier than
    the request reads them: runs of >= ``min_run`` slots (first slot, length, shift, and the
    run's rows of ``leaf`` or None; ``rows_of``: ``leaf.rows_of``), the rest with its turn tables."""
    n = slots.numel()
    if n == 0:
        return KeyPlan([], {}, None, None)
    cut = (slots[1:] - slots[:-1] != 1) | (shifts[1:] != shifts[:-1])
    if leaf is not None and rows_of is None:
        rows_of = leaf.rows_of(n)
    leafed = None if leaf is None else rows_of[:n] >= 0
    if leafed is not None:  # a run is all of one leaf or has none
        which = torch.where(leafed, leaf.which[rows_of[:n].clamp(min=0)], -1)
        cut |= which[1:] != which[:-1]
    bounds = [0, *(torch.nonzero(cut).flatten() + 1).tolist(), n]
    runs, rest = [], []
    for a, b in zip(bounds[:-1], bounds[1:]):
        if b - a >= min_run:
            part = None if leafed is None or not bool(leafed[a]) else leaf.run_part(rows_of[a:b])
            runs.append((int(slots[a]), b - a, int(shifts[a]), part))
        else:
            rest.append(torch.arange(a, b, device=slots.device))
    if not rest:
        return KeyPlan(runs, {}, None, None)
    idx = torch.cat(rest)
    return KeyPlan(runs, {}, slots[idx], _turn_tables(shifts[idx], rope), leaf_part(leaf, rows_of, idx))


def _rows(x: torch.Tensor, Hkv: int) -> torch.Tensor:
    """Queries [T, Hq, D] as rows (t, g) of each KV head: [1, Hkv, T * G, D]."""
    T, Hq, D = x.shape
    if T == 1:
        return x.view(1, Hkv, Hq // Hkv, D)
    return x.reshape(T, Hkv, Hq // Hkv, D).permute(1, 0, 2, 3).reshape(1, Hkv, -1, D)


def plan_pieces(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: KeyPlan,
    scale: float,
    rope: RopeSpec,
    layer: int = 0,
) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """(outputs, log-sum-exps) of queries q [T, Hq, D] that see every key of ``plan`` in
    k_cache / v_cache [rows, Hkv, D] (of ``layer``: the row of a KV leaf's factors), per piece
    [1, Hkv, T * G, Dv] and [1, Hkv, T * G] (rows (t, g): KV head h's G query heads of token t),
    for ``merge_pieces``."""
    D, Hkv = q.shape[-1], k_cache.shape[1]
    turned: dict = {}
    pieces = []
    for s, n, shift, part in plan.runs:
        if shift == 0:
            turned.setdefault(0, _rows(q, Hkv))
        elif shift not in turned:
            if shift not in plan.q_turn:
                plan.q_turn[shift] = _turn_matrix(-shift, D, rope, q.device).to(q.dtype)
            turned[shift] = _rows((q.reshape(-1, D) @ plan.q_turn[shift]).view(q.shape), Hkv)
        pieces.append((turned[shift], k_cache[s : s + n], v_cache[s : s + n], part))
    if plan.rest is not None:
        k, v = with_leaf(k_cache[plan.rest], v_cache[plan.rest], plan.rest_leaf, layer)
        pieces.append((_rows(q, Hkv), _turned(k, plan.rest_turn, rope), v, None))
    outs, lses = [], []
    for qg, k, v, part in pieces:
        if part is None:
            o, lse = FLASH(qg, k.movedim(0, 1).unsqueeze(0), v.movedim(0, 1).unsqueeze(0), scale=scale)[:2]
        else:
            o, lse = leaf_run(qg, k, v, part, layer, scale)
        outs.append(o)
        lses.append(lse)
    return outs, lses


def _heads(out: torch.Tensor, T: int, Hq: int) -> torch.Tensor:
    """Merged rows [1, Hkv, T * G, Dv] back to [T, Hq, Dv]."""
    Hkv = out.shape[1]
    return out.view(Hkv, T, Hq // Hkv, -1).permute(1, 0, 2, 3).reshape(T, Hq, -1)


def offset_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: KeyPlan,
    scale: float,
    rope: RopeSpec,
    layer: int = 0,
) -> torch.Tensor:
    """One decode query q [Hq, D] over the keys of ``plan``: [Hq, Dv], equal to SDPA over the
    gathered slots with each key turned by +its shift (and its leaf rows added)."""
    outs, lses = plan_pieces(q.unsqueeze(0), k_cache, v_cache, plan, scale, rope, layer)
    return _heads(merge_pieces(outs, lses, q.dtype), 1, q.shape[0])[0]


def offset_extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    shifts: torch.Tensor,
    q_pos: torch.Tensor,
    scale: float,
    rope: Optional[RopeSpec],
    before: Optional[KeyPlan] = None,
    leaf: Optional[KeyLeaf] = None,
    layer: int = 0,
) -> torch.Tensor:
    """Causal attention of an extend's queries q [T, Hq, D] (at the request's positions
    ``q_pos`` [T]) over a request's keys: ``slots`` [kv] in k_cache / v_cache, key i at the
    request's position i with RoPE ``shifts[i]`` positions earlier. [T, Hq, Dv], equal to SDPA
    over the keys turned by +shifts[i] under the mask key position <= query position. ``rope``
    may be None when no shift is set.

    The keys before the first query are seen by every query: they are attended by their plan
    (``before``: ``key_plan`` of them, e.g. kept for the other layers). The rest are gathered and
    turned. When the queries are exactly those keys' positions (an extend), they are attended
    causally, where the kernel skips the key blocks past the diagonal (half the work of a mask);
    otherwise (rows chosen for recomputation) under a mask by position. Keys with a row of
    ``leaf`` are corrected by it (``layer``'s factors)."""
    T, Hq, _ = q.shape
    Hkv, G = k_cache.shape[1], Hq // k_cache.shape[1]
    lo = int(q_pos.min())
    rows_of = None if leaf is None else leaf.rows_of(slots.numel())
    if before is None:
        before = key_plan(slots[:lo], shifts[:lo], rope, leaf=leaf, rows_of=rows_of)
    outs, lses = plan_pieces(q, k_cache, v_cache, before, scale, rope, layer)
    tail = slots[lo:]
    if tail.numel():
        k, v = with_leaf(
            k_cache[tail],
            v_cache[tail],
            leaf_part(leaf, rows_of, torch.arange(lo, slots.numel(), device=slots.device)),
            layer,
        )
        k = _turned(k, _turn_tables(shifts[lo:], rope), rope).movedim(0, 1).unsqueeze(0)
        v = v.movedim(0, 1).unsqueeze(0)
        if tail.numel() == T and torch.equal(q_pos, torch.arange(lo, lo + T, device=q_pos.device)):
            o, lse = FLASH(q.transpose(0, 1).unsqueeze(0), k, v, is_causal=True, scale=scale)[:2]  # [1, Hq, T, .]
            outs.append(o[0].view(Hkv, G, T, -1).permute(0, 2, 1, 3).reshape(1, Hkv, T * G, -1))  # rows (t, g)
            lses.append(lse[0].view(Hkv, G, T).permute(0, 2, 1).reshape(1, Hkv, T * G))
        else:
            seen = torch.arange(lo, lo + tail.numel(), device=q.device)[None, :] <= q_pos[:, None]
            seen = seen.repeat_interleave(G, 0)  # rows (t, g)
            mask = torch.zeros(seen.shape, dtype=q.dtype, device=q.device).masked_fill_(~seen, float("-inf"))
            o, lse = FLASH(_rows(q, Hkv), k, v, attn_mask=mask, scale=scale)[:2]
            outs.append(o)
            lses.append(lse.masked_fill(~seen.any(-1), float("-inf")))  # the kernel gives 0 for a row that sees no key
    return _heads(merge_pieces(outs, lses, q.dtype), T, Hq)


def slot_attention(
    q: torch.Tensor, k_cache, v_cache, slots: torch.Tensor, q_pos: Optional[torch.Tensor], scale, enable_gqa: bool
) -> torch.Tensor:
    """q [n, H, D] over the keys of ``slots`` gathered from the pool (no views, no leaves): each
    query sees the slots up to its position ``q_pos`` [n]; ``q_pos`` None: the queries are the
    slots themselves (a causal prefill). Returns [n, H, D_v]."""
    k = k_cache[slots].transpose(0, 1).to(q.dtype)  # [H_kv, kv, D]
    v = v_cache[slots].transpose(0, 1).to(q.dtype)
    mask = None if q_pos is None else torch.arange(len(slots), device=q.device)[None, :] <= q_pos[:, None]
    o = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k.unsqueeze(0),
        v.unsqueeze(0),
        attn_mask=mask,
        is_causal=q_pos is None,
        scale=scale,
        enable_gqa=enable_gqa,
    )
    return o.squeeze(0).transpose(0, 1)
