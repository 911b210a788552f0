"""Flash-LoRA-Attention over a paged KV pool: Triton kernel, launcher and dispatcher (the torch
reference and the torch serving path are beside it, in ``flash_lora_torch``).

A batch of requests; request ``b`` has ``q_len_b`` new queries (extend; 1 for decode) and
``kv_len_b`` tokens in the KV pool (cached prefix + new tokens, new last). Query ``i`` sits at
position ``kv_len_b - q_len_b + i`` and, when causal, attends keys ``0 .. that position``.

One pass over the request's keys accumulates, with the same online softmax,
    acc    = P V_base   [BLOCK_M, D]
    acc_lr = P LR_j     [BLOCK_M, r]    (LR_j: agent j's column of the LR cache)
and the epilogue adds ``acc_lr @ B_v[j, :, g*D:(g+1)*D]`` (the B projection), so the value delta
``LR_j B_v`` is never formed. With a key LR cache (QKVO adapters) each key tile gets
``cos * (LR^K B^K) + sin * (LR^K rotate_half(B^K))`` = ``RoPE(LR^K B^K)`` at the keys' positions
(position = index of the key within its request) before the scores: rotate_half acts on B's
columns, so both products stay rank r. With a key shift (KV views: a key read in the slot of
another request, where it carries RoPE ``shift`` positions earlier) each key is turned by
``cos(shift) * k + sin(shift) * rotate_half(k)`` as it is loaded, from a table of the batch's
shifts; the queries and the online softmax are untouched. With KV leaves (``KVLeafRows``: an
accepted correction kept as ``A @ B`` beside the cached K/V) the leaves a request reads are
stacked per program, their B rows side by side ([NL * r, D]); a key tile gets its key term
``A_k B_k`` (one product of the tile's A rows, each in its leaf's columns, with the stack) in the
cached key's frame, before the shift turns it, and the value term is kept low rank as the LR's:
``acc_leaf = P A_v`` ([BLOCK_M, NL * r]), ``acc_leaf @ B_v`` in the epilogue.

Layouts (last dim contiguous):
    q        [Tq, Hq, D]               new queries of all requests, concatenated
    k_buf    [S, Hkv, D]               post-RoPE base keys, KV pool (S slots)
    v_buf    [S, Hkv, D]               base values
    lr_buf   [S, n_agents, r_max]      value LR cache of one layer (``LRCache.buffers[layer]``)
    B_v      [n_agents, r_max, Hkv*D]  stacked value B factors (zero rows beyond an agent's rank)
    kv_indices [sum kv_len] int        KV slots of each request's tokens, in order
    key_shift  [sum kv_len] int        optional (``KeyShift``), aligned with kv_indices
    key_leaf                           optional (``KVLeafRows``), aligned with kv_indices
    qo_indptr, kv_indptr [B + 1] int   request offsets into q / kv_indices
    agent    [B] int                   LR column of each request's agent; -1: base model
    out      [Tq, Hq, D]               dtype of q
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from sglang_kvshare.kernels.flash_lora_torch import (  # noqa: F401 - public here too
    KeyLR,
    KeyShift,
    KVLeafRows,
    flash_lora_attention_reference,
    flash_lora_attention_sdpa,
)
from sglang_kvshare.kernels.flash_lora_triton import HAS_TRITON, flash_lora_attention_kernel
from sglang_kvshare.rope.align import RopeSpec

if HAS_TRITON:
    import triton


def rope_tables(rope: RopeSpec, max_pos: int, device, start: int = 0) -> tuple:
    """(cos, sin) [max_pos, D] float32, neox layout (``cat(f, f)``), for positions start ..
    start + max_pos - 1 (float64 angles)."""
    ang = torch.arange(start, start + max_pos, dtype=torch.float64)[:, None] * rope.inv_freq.double()[None, :]
    ang = torch.cat((ang, ang), dim=-1)
    return ang.cos().float().to(device), ang.sin().float().to(device)


def _next_pow2(n: int, floor: int = 16) -> int:
    return max(floor, 1 << (max(1, n) - 1).bit_length())


def leaf_table(leaf: torch.Tensor, kv_indptr: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """For ``KVLeafRows.leaf`` [sum kv_len]: the leaves each request reads ([B, NL] leaf ids, -1
    unused) and each key's index into its request's row of that table (-1: no leaf)."""
    n_req, dev = kv_indptr.numel() - 1, leaf.device
    req = torch.repeat_interleave(torch.arange(n_req, device=dev), (kv_indptr[1:] - kv_indptr[:-1]).long())
    has = leaf >= 0
    pairs, inverse = torch.unique(torch.stack((req[has], leaf[has].long())), dim=1, return_inverse=True)
    reqs = pairs[0].contiguous()
    local = torch.arange(pairs.shape[1], device=dev) - torch.searchsorted(reqs, reqs)
    width = int(local.max()) + 1 if local.numel() else 1
    table = torch.full((n_req, width), -1, dtype=torch.int32, device=dev)
    table[pairs[0], local] = pairs[1].to(torch.int32)
    which = torch.full(leaf.shape, -1, dtype=torch.int32, device=dev)
    which[has] = local[inverse].to(torch.int32)
    return table, which


def flash_lora_attention_triton(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    kv_indices: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    lr_buf: Optional[torch.Tensor] = None,
    B_v: Optional[torch.Tensor] = None,
    agent: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    causal: bool = True,
    key_lr: Optional[KeyLR] = None,
    key_shift: Optional[KeyShift] = None,
    key_leaf: Optional[KVLeafRows] = None,
    max_q_len: Optional[int] = None,
    block_m: Optional[int] = None,
    block_n: Optional[int] = None,
) -> torch.Tensor:
    """Launch the kernel; shapes and layouts as in the module docstring. Returns out [Tq, Hq, D].

    Blocks default to 64 x 64 on CUDA and 16 x 16 elsewhere (the Triton interpreter)."""
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed")
    Tq, Hq, D = q.shape
    S, Hkv, Dk = k_buf.shape
    assert Dk == D and v_buf.shape == k_buf.shape, "k_buf/v_buf must be [S, Hkv, D]"
    assert Hq % Hkv == 0, f"Hq={Hq} must be a multiple of Hkv={Hkv}"
    for name, t in (("q", q), ("k_buf", k_buf), ("v_buf", v_buf)):
        assert t.stride(-1) == 1, f"{name} must be contiguous in its last dim"
    num_req = qo_indptr.numel() - 1
    assert kv_indptr.numel() == num_req + 1, "qo_indptr and kv_indptr differ in length"
    has_lr = lr_buf is not None
    if agent is None:
        agent = torch.full((num_req,), -1 if not has_lr else 0, dtype=torch.int32)
    agent = agent.to(device=q.device, dtype=torch.int32)
    assert agent.numel() == num_req, "one agent index per request"
    rank = 1
    if has_lr:
        n_agents, rank = lr_buf.shape[1], lr_buf.shape[2]
        assert lr_buf.shape[0] == S and lr_buf.stride(-1) == 1, "lr_buf must be [S, n, r_max]"
        assert B_v is not None and B_v.shape == (n_agents, rank, Hkv * D), (
            f"B_v must be [{n_agents}, {rank}, {Hkv * D}], got {tuple(B_v.shape)}"
        )
        assert B_v.stride(-1) == 1, "B_v must be contiguous in its last dim"
    dummy = q.new_zeros(1)
    lrk, bk, cos, sin = dummy, dummy, dummy, dummy
    lk_strides, bk_strides, cs_stride = (0, 0), (0, 0), 0
    if key_lr is not None:
        lrk, bk, rope = key_lr
        assert rope.is_neox and rope.rotary_dim == D, "kernel supports neox RoPE over all of D"
        assert lrk.dim() == 3 and lrk.shape[0] == S and lrk.stride(-1) == 1, "lr_k_buf [S, n, r]"
        assert bk.shape == (lrk.shape[1], lrk.shape[2], Hkv * D) and bk.stride(-1) == 1, (
            f"B_k must be [{lrk.shape[1]}, {lrk.shape[2]}, {Hkv * D}], got {tuple(bk.shape)}"
        )
        assert not has_lr or lrk.shape[1:] == lr_buf.shape[1:], "key and value LR need one r_max"
        rank = lrk.shape[2]
        max_kv = int((kv_indptr[1:] - kv_indptr[:-1]).max().item()) if num_req else 1
        cos, sin = rope_tables(rope, max(1, max_kv), q.device)
        lk_strides, bk_strides, cs_stride = (lrk.stride(0), lrk.stride(1)), (bk.stride(0), bk.stride(1)), cos.stride(0)
    shift, scos, ssin, shift_lo = dummy, dummy, dummy, 0
    if key_shift is not None:
        shift, rope = key_shift
        assert rope.is_neox and rope.rotary_dim == D, "kernel supports neox RoPE over all of D"
        assert shift.shape == kv_indices.shape, "key_shift.shift must align with kv_indices"
        shift = shift.to(device=q.device, dtype=torch.int32).contiguous()
        shift_lo = int(shift.min().item()) if shift.numel() else 0
        hi = int(shift.max().item()) if shift.numel() else 0
        scos, ssin = rope_tables(rope, hi - shift_lo + 1, q.device, start=shift_lo)
    lwhich, lrow, ltab, lak, lav, lbk, lbv = (dummy.view(1, 1, 1),) * 7
    nleaf, lrank = 1, 1
    if key_leaf is not None:
        lrow, lak, lbk, lav, lbv = key_leaf[1:]
        lrank = lak.shape[1]
        assert key_leaf.leaf.shape == lrow.shape == kv_indices.shape, "key_leaf must align with kv_indices"
        assert lav.shape == lak.shape and lak.stride(-1) == lav.stride(-1) == 1, "A_k, A_v [rows, r]"
        assert lbk.shape == lbv.shape == (lbk.shape[0], lrank, Hkv * D) and lbk.stride(-1) == lbv.stride(-1) == 1, (
            f"B_k, B_v must be [n_leaves, {lrank}, {Hkv * D}]"
        )
        ltab, lwhich = leaf_table(key_leaf.leaf, kv_indptr)
        lrow, nleaf = lrow.to(torch.int32).contiguous(), ltab.shape[1]
    if max_q_len is None:
        max_q_len = int((qo_indptr[1:] - qo_indptr[:-1]).max().item()) if num_req else 0
    out = torch.empty_like(q)
    if num_req == 0 or max_q_len == 0:
        return out
    lr_t = lr_buf if has_lr else dummy.view(1, 1, 1)
    bv_t = B_v if has_lr else dummy.view(1, 1, 1)
    block_m = block_m or (64 if q.is_cuda else 16)
    block_n = block_n or (64 if q.is_cuda else 16)
    grid = (num_req, Hq, triton.cdiv(max_q_len, block_m))
    flash_lora_attention_kernel[grid](
        q,
        k_buf,
        v_buf,
        lr_t,
        bv_t,
        out,
        kv_indices,
        qo_indptr,
        kv_indptr,
        agent,
        lrk,
        bk,
        cos,
        sin,
        shift,
        scos,
        ssin,
        shift_lo,
        lwhich,
        lrow,
        ltab,
        lak,
        lav,
        lbk,
        lbv,
        D**-0.5 if scale is None else scale,
        q.stride(0),
        q.stride(1),
        k_buf.stride(0),
        k_buf.stride(1),
        v_buf.stride(0),
        v_buf.stride(1),
        lr_t.stride(0),
        lr_t.stride(1),
        bv_t.stride(0),
        bv_t.stride(1),
        out.stride(0),
        out.stride(1),
        *lk_strides,
        *bk_strides,
        cs_stride,
        scos.stride(0) if key_shift is not None else 0,
        ltab.stride(0),
        lak.stride(0),
        lav.stride(0),
        lbk.stride(0),
        lbk.stride(1),
        lbv.stride(0),
        lbv.stride(1),
        GROUP=Hq // Hkv,
        HEAD_DIM=D,
        RANK=rank,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=_next_pow2(D),
        BLOCK_R=_next_pow2(rank),
        CAUSAL=causal,
        HAS_LR=has_lr,
        HAS_KEY_LR=key_lr is not None,
        HAS_SHIFT=key_shift is not None,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        HAS_LEAF=key_leaf is not None,
        NLEAF=nleaf,
        LRANK=lrank,
        BLOCK_RL=_next_pow2(lrank, 1),
        BLOCK_L=max(16, _next_pow2(nleaf, 1) * _next_pow2(lrank, 1)),
    )
    return out


def flash_lora_attention_paged(*args, **kwargs) -> torch.Tensor:
    """Dispatcher: the Triton kernel for CUDA tensors, the torch SDPA path elsewhere (value and
    key LR, key shifts, KV leaves)."""
    q = args[0] if args else kwargs["q"]
    if HAS_TRITON and q.is_cuda:
        return flash_lora_attention_triton(*args, **kwargs)
    return flash_lora_attention_sdpa(*args, **kwargs)
