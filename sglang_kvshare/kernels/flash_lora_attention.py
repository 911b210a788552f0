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
shifts; the queries and the online softmax are untouched.

Layouts (last dim contiguous):
    q        [Tq, Hq, D]               new queries of all requests, concatenated
    k_buf    [S, Hkv, D]               post-RoPE base keys, KV pool (S slots)
    v_buf    [S, Hkv, D]               base values
    lr_buf   [S, n_agents, r_max]      value LR cache of one layer (``LRCache.buffers[layer]``)
    B_v      [n_agents, r_max, Hkv*D]  stacked value B factors (zero rows beyond an agent's rank)
    kv_indices [sum kv_len] int        KV slots of each request's tokens, in order
    key_shift  [sum kv_len] int        optional (``KeyShift``), aligned with kv_indices
    qo_indptr, kv_indptr [B + 1] int   request offsets into q / kv_indices
    agent    [B] int                   LR column of each request's agent; -1: base model
    out      [Tq, Hq, D]               dtype of q
"""

from __future__ import annotations

from typing import Optional

import torch

from sglang_kvshare.kernels.flash_lora_torch import (  # noqa: F401 - public here too
    KeyLR,
    KeyShift,
    flash_lora_attention_reference,
    flash_lora_attention_sdpa,
)
from sglang_kvshare.rope.align import RopeSpec

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - triton ships with torch on CUDA machines
    HAS_TRITON = False


if HAS_TRITON:

    @triton.jit
    def _flash_lora_attention_kernel(
        Q, K, V, LR, BV, O,
        KV_IDX, QO_INDPTR, KV_INDPTR, AGENT,
        LRK, BK, COS, SIN, SHIFT, SCOS, SSIN, shift_lo,
        sm_scale,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
        stride_lrt, stride_lra, stride_ba, stride_br, stride_ot, stride_oh,
        stride_lkt, stride_lka, stride_bka, stride_bkr, stride_cs, stride_ss,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, RANK: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_R: tl.constexpr, CAUSAL: tl.constexpr, HAS_LR: tl.constexpr,
        HAS_KEY_LR: tl.constexpr, HAS_SHIFT: tl.constexpr, PRECISION: tl.constexpr,
    ):
        b = tl.program_id(0)
        h = tl.program_id(1)
        mblk = tl.program_id(2)
        g = h // GROUP
        q_beg = tl.load(QO_INDPTR + b)
        q_len = tl.load(QO_INDPTR + b + 1) - q_beg
        kv_beg = tl.load(KV_INDPTR + b)
        kv_len = tl.load(KV_INDPTR + b + 1) - kv_beg
        if mblk * BLOCK_M < q_len:
            q_start = kv_len - q_len
            agent = tl.load(AGENT + b)
            offs_m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
            offs_d = tl.arange(0, BLOCK_D)
            offs_r = tl.arange(0, BLOCK_R)
            m_mask = offs_m < q_len
            d_mask = offs_d < HEAD_DIM
            r_mask = offs_r < tl.where(agent >= 0, RANK, 0)  # base-model request: no LR
            agent_c = tl.maximum(agent, 0)
            # q: [BLOCK_M, BLOCK_D]
            q = tl.load(
                Q + (q_beg + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0,
            ).to(tl.float32)
            m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
            acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
            acc_lr = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
            half: tl.constexpr = HEAD_DIM // 2
            rot_d = tl.where(offs_d < half, offs_d + half, offs_d - half)  # rotate_half's gather
            sign = tl.where(offs_d < half, -1.0, 1.0)
            if HAS_KEY_LR:
                rd_mask = r_mask[:, None] & d_mask[None, :]
                bk_base = BK + agent_c * stride_bka + offs_r[:, None] * stride_bkr + g * HEAD_DIM
                # bk, bk_rh: [BLOCK_R, BLOCK_D]; bk_rh = rotate_half(B^K) along D
                bk = tl.load(bk_base + offs_d[None, :], mask=rd_mask, other=0.0).to(tl.float32)
                bk_rh = tl.load(bk_base + rot_d[None, :], mask=rd_mask, other=0.0).to(tl.float32)
                bk_rh = bk_rh * sign[None, :]
            kv_end = kv_len
            if CAUSAL:
                kv_end = tl.minimum(kv_len, q_start + (mblk + 1) * BLOCK_M)
            for n0 in range(0, kv_end, BLOCK_N):
                offs_n = n0 + tl.arange(0, BLOCK_N)
                n_mask = offs_n < kv_len
                slot = tl.load(KV_IDX + kv_beg + offs_n, mask=n_mask, other=0).to(tl.int64)
                nd_mask = n_mask[:, None] & d_mask[None, :]
                # k: [BLOCK_N, BLOCK_D]
                k = tl.load(K + slot[:, None] * stride_kt + g * stride_kh + offs_d[None, :],
                            mask=nd_mask, other=0.0).to(tl.float32)
                if HAS_SHIFT:
                    # the key turned by its shift: cos * k + sin * rotate_half(k)
                    row = tl.load(SHIFT + kv_beg + offs_n, mask=n_mask, other=shift_lo) - shift_lo
                    cs = row[:, None] * stride_ss + offs_d[None, :]
                    k_rh = tl.load(K + slot[:, None] * stride_kt + g * stride_kh + rot_d[None, :],
                                   mask=nd_mask, other=0.0).to(tl.float32) * sign[None, :]
                    k = k * tl.load(SCOS + cs, mask=nd_mask, other=0.0) + k_rh * tl.load(
                        SSIN + cs, mask=nd_mask, other=0.0)
                if HAS_KEY_LR:
                    # lrk: [BLOCK_N, BLOCK_R]; key delta RoPE(lrk @ B^K) at positions offs_n
                    lrk = tl.load(LRK + slot[:, None] * stride_lkt + agent_c * stride_lka
                                  + offs_r[None, :], mask=n_mask[:, None] & r_mask[None, :],
                                  other=0.0).to(tl.float32)
                    cos = tl.load(COS + offs_n[:, None] * stride_cs + offs_d[None, :],
                                  mask=nd_mask, other=0.0)
                    sin = tl.load(SIN + offs_n[:, None] * stride_cs + offs_d[None, :],
                                  mask=nd_mask, other=0.0)
                    k += cos * tl.dot(lrk, bk, input_precision=PRECISION)
                    k += sin * tl.dot(lrk, bk_rh, input_precision=PRECISION)
                # s: [BLOCK_M, BLOCK_N]
                s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * sm_scale
                valid = m_mask[:, None] & n_mask[None, :]
                if CAUSAL:
                    valid = valid & (offs_n[None, :] <= (q_start + offs_m)[:, None])
                s = tl.where(valid, s, -1.0e30)
                m_new = tl.maximum(m_i, tl.max(s, 1))
                p = tl.exp(s - m_new[:, None])
                p = tl.where(valid, p, 0.0)
                alpha = tl.exp(m_i - m_new)
                l_i = l_i * alpha + tl.sum(p, 1)
                v = tl.load(V + slot[:, None] * stride_vt + g * stride_vh + offs_d[None, :],
                            mask=nd_mask, other=0.0).to(tl.float32)
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
                if HAS_LR:
                    # lr: [BLOCK_N, BLOCK_R]
                    lr = tl.load(LR + slot[:, None] * stride_lrt + agent_c * stride_lra
                                 + offs_r[None, :], mask=n_mask[:, None] & r_mask[None, :],
                                 other=0.0).to(tl.float32)
                    acc_lr = acc_lr * alpha[:, None] + tl.dot(p, lr, input_precision=PRECISION)
                m_i = m_new
            l_safe = tl.where(l_i > 0.0, l_i, 1.0)
            acc = acc / l_safe[:, None]
            if HAS_LR:
                acc_lr = acc_lr / l_safe[:, None]
                # bv: [BLOCK_R, BLOCK_D], KV head g's columns of agent's B_v
                bv = tl.load(BV + agent_c * stride_ba + offs_r[:, None] * stride_br
                             + g * HEAD_DIM + offs_d[None, :],
                             mask=r_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
                acc += tl.dot(acc_lr, bv, input_precision=PRECISION)
            tl.store(O + (q_beg + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
                     acc.to(O.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def rope_tables(rope: RopeSpec, max_pos: int, device, start: int = 0) -> tuple:
    """(cos, sin) [max_pos, D] float32, neox layout (``cat(f, f)``), for positions start ..
    start + max_pos - 1 (float64 angles)."""
    ang = torch.arange(start, start + max_pos, dtype=torch.float64)[:, None] * rope.inv_freq.double()[None, :]
    ang = torch.cat((ang, ang), dim=-1)
    return ang.cos().float().to(device), ang.sin().float().to(device)


def _next_pow2(n: int, floor: int = 16) -> int:
    return max(floor, 1 << (max(1, n) - 1).bit_length())


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
            f"B_v must be [{n_agents}, {rank}, {Hkv * D}], got {tuple(B_v.shape)}")
        assert B_v.stride(-1) == 1, "B_v must be contiguous in its last dim"
    dummy = q.new_zeros(1)
    lrk, bk, cos, sin = dummy, dummy, dummy, dummy
    lk_strides, bk_strides, cs_stride = (0, 0), (0, 0), 0
    if key_lr is not None:
        lrk, bk, rope = key_lr
        assert rope.is_neox and rope.rotary_dim == D, "kernel supports neox RoPE over all of D"
        assert lrk.dim() == 3 and lrk.shape[0] == S and lrk.stride(-1) == 1, "lr_k_buf [S, n, r]"
        assert bk.shape == (lrk.shape[1], lrk.shape[2], Hkv * D) and bk.stride(-1) == 1, (
            f"B_k must be [{lrk.shape[1]}, {lrk.shape[2]}, {Hkv * D}], got {tuple(bk.shape)}")
        assert not has_lr or lrk.shape[1:] == lr_buf.shape[1:], "key and value LR need one r_max"
        rank = lrk.shape[2]
        max_kv = int((kv_indptr[1:] - kv_indptr[:-1]).max().item()) if num_req else 1
        cos, sin = rope_tables(rope, max(1, max_kv), q.device)
        lk_strides, bk_strides, cs_stride = (lrk.stride(0), lrk.stride(1)), (
            bk.stride(0), bk.stride(1)), cos.stride(0)
    shift, scos, ssin, shift_lo = dummy, dummy, dummy, 0
    if key_shift is not None:
        shift, rope = key_shift
        assert rope.is_neox and rope.rotary_dim == D, "kernel supports neox RoPE over all of D"
        assert shift.shape == kv_indices.shape, "key_shift.shift must align with kv_indices"
        shift = shift.to(device=q.device, dtype=torch.int32).contiguous()
        shift_lo = int(shift.min().item()) if shift.numel() else 0
        hi = int(shift.max().item()) if shift.numel() else 0
        scos, ssin = rope_tables(rope, hi - shift_lo + 1, q.device, start=shift_lo)
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
    _flash_lora_attention_kernel[grid](
        q, k_buf, v_buf, lr_t, bv_t, out,
        kv_indices, qo_indptr, kv_indptr, agent,
        lrk, bk, cos, sin, shift, scos, ssin, shift_lo,
        D ** -0.5 if scale is None else scale,
        q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1),
        v_buf.stride(0), v_buf.stride(1),
        lr_t.stride(0), lr_t.stride(1), bv_t.stride(0), bv_t.stride(1),
        out.stride(0), out.stride(1),
        *lk_strides, *bk_strides, cs_stride, scos.stride(0) if key_shift is not None else 0,
        GROUP=Hq // Hkv, HEAD_DIM=D, RANK=rank,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=_next_pow2(D), BLOCK_R=_next_pow2(rank),
        CAUSAL=causal, HAS_LR=has_lr, HAS_KEY_LR=key_lr is not None, HAS_SHIFT=key_shift is not None,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    return out


def flash_lora_attention_paged(*args, **kwargs) -> torch.Tensor:
    """Dispatcher: the Triton kernel for CUDA tensors, the torch SDPA path elsewhere (value and
    key LR, key shifts)."""
    q = args[0] if args else kwargs["q"]
    if HAS_TRITON and q.is_cuda:
        return flash_lora_attention_triton(*args, **kwargs)
    return flash_lora_attention_sdpa(*args, **kwargs)
