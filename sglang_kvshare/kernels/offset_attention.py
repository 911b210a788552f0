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

A KV leaf (``KeyLeaf``): some keys and values are read as the cached ones plus a low-rank
correction (an accepted KVCMAS correction kept as ``A @ B`` beside the source's KV instead of a
corrected copy). A long run with a leaf is still attended in place, its leaf as two low-rank
terms (PReCache's LR attention, ``PV + (PA_v)B_v``, with the key term ``(q B_k^T) A_k^T`` added
to the scores); short leaf spans are gathered with the rest and corrected before they are turned.

- ``offset_decode_attention``: one decode query over a ``KeyPlan``.
- ``offset_extend_attention``: an extend's queries over a request's slots: the keys before the
  first query (every query sees them) by their plan, the rest gathered, causally (an extend) or
  under a mask by position (rows chosen for recomputation). Requests without views use it too
  when keys precede their queries (shifts 0: runs attended in place, no turn): SDPA's mask
  over a prefix makes the CPU kernel compute every key block, twice the work of a causal extend.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, List, NamedTuple, Optional, Tuple

import torch

from sglang_kvshare.kernels.split_decode import MIN_RUN, merge_pieces
from sglang_kvshare.rope.align import RopeSpec, rotate

if TYPE_CHECKING:
    from sglang_kvshare.lowrank import LowRank

_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


class KeyLeaf(NamedTuple):
    """Low-rank corrections of rows ``pos`` [m] (positions in a request's slots) of its keys and
    values: ``k`` and ``v`` are ``LowRank`` with A [L, m, R], B [L, R, H * D] (one per layer; keys
    in the RoPE frame of the cached rows they correct)."""

    pos: torch.Tensor
    k: "LowRank"
    v: "LowRank"

    def rows_of(self, n: int) -> torch.Tensor:
        """[n] int64: the leaf row of each of the first ``n`` positions, -1 where it has none."""
        rows = torch.full((n,), -1, dtype=torch.int64, device=self.pos.device)
        inside = self.pos < n
        rows[self.pos[inside]] = torch.arange(self.pos.numel(), device=self.pos.device)[inside]
        return rows


def leaf_part(leaf: Optional[KeyLeaf], rows_of: Optional[torch.Tensor], positions: torch.Tensor):
    """The leaf rows of gathered ``positions``: (selected rows of the piece, their leaf rows,
    leaf), or None when none carries one."""
    if leaf is None:
        return None
    rows = rows_of[positions]
    sel = torch.nonzero(rows >= 0).flatten()
    return None if sel.numel() == 0 else (sel, rows[sel], leaf)


def with_leaf(k: torch.Tensor, v: torch.Tensor, part, layer: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Gathered k, v [n, H, D] (copies the caller owns) with ``layer``'s leaf rows of ``part``
    (``leaf_part``) added, in float32 and cast back."""
    if part is None:
        return k, v
    sel, rows, leaf = part
    H, D = k.shape[1:]
    out = []
    for x, f in ((k, leaf.k), (v, leaf.v)):
        y = x.float()
        y[sel] += (f.A[layer, rows].float() @ f.B[layer].float()).view(-1, H, D)
        out.append(y.to(x.dtype))
    return out[0], out[1]


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


def key_plan(slots: torch.Tensor, shifts: torch.Tensor, rope: RopeSpec, min_run: int = MIN_RUN,
             leaf: Optional[KeyLeaf] = None, rows_of: Optional[torch.Tensor] = None) -> KeyPlan:
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
    if leafed is not None:
        cut |= leafed[1:] != leafed[:-1]
    bounds = [0, *(torch.nonzero(cut).flatten() + 1).tolist(), n]
    runs, rest = [], []
    for a, b in zip(bounds[:-1], bounds[1:]):
        if b - a >= min_run:
            part = None if leafed is None or not bool(leafed[a]) else (rows_of[a:b], leaf)
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


def plan_pieces(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: KeyPlan, scale: float,
                rope: RopeSpec, layer: int = 0) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
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
            o, lse = _FLASH(qg, k.movedim(0, 1).unsqueeze(0), v.movedim(0, 1).unsqueeze(0), scale=scale)[:2]
        else:
            o, lse = _leaf_run(qg, k, v, part, layer, scale)
        outs.append(o)
        lses.append(lse)
    return outs, lses


def _leaf_run(qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor, part, layer: int, scale: float):
    """Query rows qg [1, Hkv, R, D] over a run of cached k, v [n, Hkv, D] read through the
    run's leaf rows ``part`` (rows [n], KeyLeaf): scores ``q.k + (q B_k^T) A_k^T`` (the key term
    as the kernel's additive mask), output ``PV + (P A_v) B_v`` (``P A_v`` from a second call
    with A_v zero-padded to the head size as values: the CPU kernel needs equal head sizes);
    (output [1, Hkv, R, Dv] in qg's dtype, lse [1, Hkv, R])."""
    rows, leaf = part
    n, Hkv, D = k.shape
    a_k, a_v = leaf.k.A[layer, rows], leaf.v.A[layer, rows]  # [n, r]
    b_k = leaf.k.B[layer].float().view(-1, Hkv, D).transpose(0, 1)  # [Hkv, r, D]
    b_v = leaf.v.B[layer].float().view(-1, Hkv, v.shape[-1]).transpose(0, 1)
    bias = ((qg[0].float() @ b_k.transpose(1, 2)) @ a_k.float().T).mul_(scale).to(qg.dtype).unsqueeze(0)
    keys = k.movedim(0, 1).unsqueeze(0)
    o, lse = _FLASH(qg, keys, v.movedim(0, 1).unsqueeze(0), attn_mask=bias, scale=scale)[:2]
    r = a_v.shape[-1]
    if r <= D:
        padded = a_v.new_zeros(n, D).to(qg.dtype)
        padded[:, :r] = a_v
        pa = _FLASH(qg, keys, padded.expand(Hkv, n, D).unsqueeze(0), attn_mask=bias, scale=scale)[0][0, ..., :r]
    else:  # leaves of more columns than a head: P explicitly
        p = torch.exp((qg[0].float() @ keys[0].float().transpose(1, 2)) * scale + bias[0].float() - lse[0, ..., None])
        pa = p @ a_v.float()
    return (o[0].float() + pa.float() @ b_v).unsqueeze(0).to(qg.dtype), lse


def _heads(out: torch.Tensor, T: int, Hq: int) -> torch.Tensor:
    """Merged rows [1, Hkv, T * G, Dv] back to [T, Hq, Dv]."""
    Hkv = out.shape[1]
    return out.view(Hkv, T, Hq // Hkv, -1).permute(1, 0, 2, 3).reshape(T, Hq, -1)


def offset_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: KeyPlan, scale: float, rope: RopeSpec,
    layer: int = 0,
) -> torch.Tensor:
    """One decode query q [Hq, D] over the keys of ``plan``: [Hq, Dv], equal to SDPA over the
    gathered slots with each key turned by +its shift (and its leaf rows added)."""
    outs, lses = plan_pieces(q.unsqueeze(0), k_cache, v_cache, plan, scale, rope, layer)
    return _heads(merge_pieces(outs, lses, q.dtype), 1, q.shape[0])[0]


def offset_extend_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, shifts: torch.Tensor,
    q_pos: torch.Tensor, scale: float, rope: Optional[RopeSpec], before: Optional[KeyPlan] = None,
    leaf: Optional[KeyLeaf] = None, layer: int = 0,
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
        k, v = with_leaf(k_cache[tail], v_cache[tail],
                         leaf_part(leaf, rows_of, torch.arange(lo, slots.numel(), device=slots.device)), layer)
        k = _turned(k, _turn_tables(shifts[lo:], rope), rope).movedim(0, 1).unsqueeze(0)
        v = v.movedim(0, 1).unsqueeze(0)
        if tail.numel() == T and torch.equal(q_pos, torch.arange(lo, lo + T, device=q_pos.device)):
            o, lse = _FLASH(q.transpose(0, 1).unsqueeze(0), k, v, is_causal=True, scale=scale)[:2]  # [1, Hq, T, .]
            outs.append(o[0].view(Hkv, G, T, -1).permute(0, 2, 1, 3).reshape(1, Hkv, T * G, -1))  # rows (t, g)
            lses.append(lse[0].view(Hkv, G, T).permute(0, 2, 1).reshape(1, Hkv, T * G))
        else:
            seen = (torch.arange(lo, lo + tail.numel(), device=q.device)[None, :] <= q_pos[:, None])
            seen = seen.repeat_interleave(G, 0)  # rows (t, g)
            mask = torch.zeros(seen.shape, dtype=q.dtype, device=q.device).masked_fill_(~seen, float("-inf"))
            o, lse = _FLASH(_rows(q, Hkv), k, v, attn_mask=mask, scale=scale)[:2]
            outs.append(o)
            lses.append(lse.masked_fill(~seen.any(-1), float("-inf")))  # the kernel gives 0 for a row that sees no key
    return _heads(merge_pieces(outs, lses, q.dtype), T, Hq)
