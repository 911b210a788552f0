"""KV leaves in attention: keys and values read as the cached ones plus a low-rank correction.

An accepted KVCMAS correction kept as ``A @ B`` beside the source's KV (``cache/leaves.py``)
instead of a corrected copy in new slots. A long run with a leaf is attended with the leaf as
two low-rank terms (PReCache's LR attention, ``PV + (PA_v)B_v``, with the key term
``(q B_k^T) A_k^T`` added to the scores: ``leaf_run``); short leaf spans are gathered with the
other keys and corrected first (``with_leaf``). ``kernels.offset_attention`` plans the runs.
``leaf_rows`` gives a batch's leaves to the paged kernels (the Triton kernel on the GPU path).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from sglang_kvshare.kernels.flash_lora_torch import KVLeafRows

if TYPE_CHECKING:
    from sglang_kvshare.lowrank import LowRank

FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
EXPLICIT_ROWS = 16  # query rows per KV head up to which a leafed run's scores are explicit (a decode step)


class KeyLeaf(NamedTuple):
    """Low-rank corrections of rows ``pos`` [m] (positions in a request's slots) of its keys and
    values: row ``rows[i]`` of leaf ``which[i]``, whose factors are ``k[which[i]]`` and
    ``v[which[i]]`` (``LowRank`` with A [L, rows, R], B [L, R, H * D], one per layer; keys in the
    RoPE frame of the cached rows they correct). Several leaves stay apart (no block-diagonal
    join): a run of one leaf attends at that leaf's rank."""

    pos: torch.Tensor
    which: torch.Tensor
    rows: torch.Tensor
    k: Tuple["LowRank", ...]
    v: Tuple["LowRank", ...]

    @staticmethod
    def single(pos: torch.Tensor, k: "LowRank", v: "LowRank") -> "KeyLeaf":
        """One leaf whose row i corrects position ``pos[i]``."""
        rows = torch.arange(pos.numel(), device=pos.device)
        return KeyLeaf(pos, torch.zeros_like(rows), rows, (k,), (v,))

    def rows_of(self, n: int) -> torch.Tensor:
        """[n] int64: the entry (index into ``pos``) of each of the first ``n`` positions, -1
        where it has none."""
        entries = torch.full((n,), -1, dtype=torch.int64, device=self.pos.device)
        inside = self.pos < n
        entries[self.pos[inside]] = torch.arange(self.pos.numel(), device=self.pos.device)[inside]
        return entries

    def run_part(self, entries: torch.Tensor) -> "LeafRun":
        """The ``LeafRun`` of a run's ``entries`` (all of one leaf)."""
        which, rows = int(self.which[entries[0]]), self.rows[entries]
        first = int(rows[0])
        contiguous = bool((rows == torch.arange(first, first + rows.numel(), device=rows.device)).all())
        return LeafRun(slice(first, first + rows.numel()) if contiguous else rows, self.k[which], self.v[which])


class LeafRun(NamedTuple):
    """A run's rows of one leaf: ``rows`` (a slice where they are consecutive, no gather) of
    the factors ``k``, ``v``."""

    rows: object
    k: "LowRank"
    v: "LowRank"


def leaf_part(leaf: Optional[KeyLeaf], rows_of: Optional[torch.Tensor], positions: torch.Tensor):
    """The leaf rows of gathered ``positions``, per leaf: a list of (selected rows of the piece,
    their rows of the leaf, its k and v factors), or None when none carries one. Built once per
    plan, used by every layer."""
    if leaf is None:
        return None
    entries = rows_of[positions]
    sel = torch.nonzero(entries >= 0).flatten()
    if sel.numel() == 0:
        return None
    which, rows = leaf.which[entries[sel]], leaf.rows[entries[sel]]
    return [(sel[which == j], rows[which == j], leaf.k[j], leaf.v[j]) for j in torch.unique(which).tolist()]


def with_leaf(k: torch.Tensor, v: torch.Tensor, part, layer: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Gathered k, v [n, H, D] (copies the caller owns) with ``layer``'s leaf rows of ``part``
    (``leaf_part``) added, in float32 and cast back."""
    if part is None:
        return k, v
    H, D = k.shape[1:]
    y, z = k.float(), v.float()
    for sel, rows, fk, fv in part:
        y[sel] += (fk.A[layer, rows].float() @ fk.B[layer].float()).view(-1, H, D)
        z[sel] += (fv.A[layer, rows].float() @ fv.B[layer].float()).view(-1, H, D)
    return y.to(k.dtype), z.to(v.dtype)


def leaf_run(qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor, part: LeafRun, layer: int, scale: float):
    """Query rows qg [1, Hkv, R, D] over a run of cached k, v [n, Hkv, D] read through the
    run's leaf rows ``part``: scores ``q.k + (q B_k^T) A_k^T``, output ``PV + (P A_v) B_v``;
    (output [1, Hkv, R, Dv] in qg's dtype, lse [1, Hkv, R]).

    Few query rows (a decode step) take the scores explicitly, one pass over the keys and one
    over the values, read in place (on this CPU 1.4-1.7x a plain run's kernel call). More rows
    take one call of the CPU flash kernel, which does not materialise the scores, over the
    leaf's rank as extra channels: queries ``[q | q B_k^T]``, keys ``[k | A_k]``, values
    ``[v | A_v]`` (D + r channels each, as the kernel needs one head size; a narrower side is
    zero-padded), which gives ``[PV | P A_v]`` in one pass; the widened keys and values are
    copies made per call."""
    n, Hkv, D = k.shape
    a_k, a_v = part.k.A[layer, part.rows].float(), part.v.A[layer, part.rows].float()  # [n, r]
    b_k = part.k.B[layer].float().view(-1, Hkv, D).transpose(0, 1)  # [Hkv, r, D]
    b_v = part.v.B[layer].float().view(-1, Hkv, v.shape[-1]).transpose(0, 1)
    q = qg[0].float()
    qb = q @ b_k.transpose(1, 2)  # [Hkv, R, r]
    if q.shape[1] <= EXPLICIT_ROWS:
        s = torch.baddbmm(qb @ a_k.T, q, k.permute(1, 2, 0).float(), alpha=scale, beta=scale)
        top = s.amax(-1, keepdim=True)
        p = s.sub_(top).exp_()
        total = p.sum(-1, keepdim=True)
        o = torch.baddbmm(torch.bmm(p, v.permute(1, 0, 2).float()), p @ a_v, b_v).div_(total)
        return o.unsqueeze(0).to(qg.dtype), (top + total.log()).squeeze(-1).unsqueeze(0)
    dt, Dv, r_v = qg.dtype, v.shape[-1], a_v.shape[-1]
    width = max(D + a_k.shape[-1], Dv + r_v)  # zero channels where one side is narrower

    def wide(x, extra):  # [x | extra | zeros] along the channels, one cat (F.pad after it copies again)
        parts = [x.to(dt), extra.to(dt).expand(*x.shape[:-1], -1)]
        if width > x.shape[-1] + extra.shape[-1]:
            parts.append(x.new_zeros(*x.shape[:-1], width - x.shape[-1] - extra.shape[-1]))
        return torch.cat(parts, -1).unsqueeze(0)

    o, lse = FLASH(wide(qg[0], qb), wide(k.movedim(0, 1), a_k), wide(v.movedim(0, 1), a_v), scale=scale)[:2]
    return (o[0, ..., :Dv].float() + o[0, ..., Dv : Dv + r_v].float() @ b_v).unsqueeze(0).to(dt), lse


def leaf_rows(leaves: Sequence[Optional[KeyLeaf]], kv_lens: Sequence[int], layer: int) -> Optional[KVLeafRows]:
    """The paged kernels' leaf inputs (``KVLeafRows``, aligned with the batch's kv_indices) of
    ``layer`` for a batch whose request b reads ``leaves[b]`` (None: none) over ``kv_lens[b]``
    keys: each distinct leaf once (factors two requests share, e.g. an inherited leaf, are
    stacked once), A rows concatenated, ranks zero-padded to the largest. None when no request
    reads a leaf."""
    stacked: dict = {}  # id of a leaf's key factors -> (its index, its first row in the stack)
    factors, offset, leaf_ids, row_ids = [], 0, [], []
    for leaf, n in zip(leaves, kv_lens):
        ids = torch.full((n,), -1, dtype=torch.int64)
        rows = torch.zeros(n, dtype=torch.int64)
        if leaf is not None:
            for fk, fv in zip(leaf.k, leaf.v):
                if id(fk) not in stacked:
                    stacked[id(fk)] = (len(factors), offset)
                    factors.append((fk, fv))
                    offset += fk.A.shape[1]
            index = torch.tensor([stacked[id(fk)] for fk in leaf.k], dtype=torch.int64)
            inside = leaf.pos < n
            at, which = leaf.pos[inside].cpu(), leaf.which[inside].cpu()
            ids[at] = index[which, 0]
            rows[at] = index[which, 1] + leaf.rows[inside].cpu()
        leaf_ids.append(ids)
        row_ids.append(rows)
    if not factors:
        return None
    r = max(f.rank for pair in factors for f in pair)

    def side(fs):  # one side's A rows concatenated and B stacked, ranks zero-padded to r
        return (
            torch.cat([F.pad(f.A[layer], (0, r - f.rank)) for f in fs]),
            torch.stack([F.pad(f.B[layer], (0, 0, 0, r - f.rank)) for f in fs]),
        )

    (A_k, B_k), (A_v, B_v) = side([fk for fk, _ in factors]), side([fv for _, fv in factors])
    dev = A_k.device
    return KVLeafRows(torch.cat(leaf_ids).to(dev), torch.cat(row_ids).to(dev), A_k, B_k, A_v, B_v)
