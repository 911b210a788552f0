"""Fused KV injection for one layer: gather source rows, re-align keys, add a low-rank delta,
write destination rows.

    k_pool[dst[t]] = R(pos_delta[t]) k_pool[src[t]] + R(delta_pos[t]) (A_k @ B_k)[t]
    v_pool[dst[t]] = v_pool[src[t]] + (A_v @ B_v)[t]

Pools are one layer of the KV pool: [rows, kv_heads, head_dim] (NHD), last dim contiguous.
R(d) is the RoPE rotation by d positions (NeoX or GPT-J pairs, ``RopeSpec``). Deltas from the
correction methods are in canonical coordinates (segment at position 0), so their keys are moved
by ``delta_pos`` = the destination segment's start position; ``None`` leaves them unrotated.
A token-weighted mix of anchor deltas sum_v w_v[t] A_v[t] B_v is one low-rank product with
A = [w_1 A_1 | ... | w_V A_V] ([T, V r]) and B = [B_1; ...; B_V] ([V r, D]).

Angles are computed on the host side in float64 (as ``rope.shift_keys``) and passed as cos/sin
tables [T, rotary_dim / 2]; all arithmetic is float32, the result is cast to the pool dtype once.
Contract: the pools are mutated in place at rows ``dst``; ``dst`` must not overlap ``src`` (the
Triton kernel reads and writes rows concurrently).
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from sglang_kvshare.lowrank import LowRank
from sglang_kvshare.rope import RopeSpec, shift_keys

try:  # triton is optional: CPU installs use the torch reference
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None

Shift = Union[int, torch.Tensor]


def _shift_vector(shift: Optional[Shift], T: int, device) -> torch.Tensor:
    """int / [T] tensor / None -> [T] float64 positions on ``device``."""
    if shift is None:
        return torch.zeros(T, dtype=torch.float64, device=device)
    if isinstance(shift, int):
        return torch.full((T,), float(shift), dtype=torch.float64, device=device)
    if shift.numel() != T:
        raise ValueError(f"per-token shift must have {T} entries, got {shift.numel()}")
    return shift.reshape(-1).to(device=device, dtype=torch.float64)


def _check(k_pool, v_pool, src_idx, dst_idx, spec, k_delta, v_delta) -> None:
    assert k_pool.dim() == 3 and k_pool.shape == v_pool.shape, "pools must be [rows, H, Dh]"
    assert k_pool.dtype == v_pool.dtype and k_pool.device == v_pool.device
    assert src_idx.dim() == 1 and src_idx.shape == dst_idx.shape, "src/dst must be [T]"
    assert not src_idx.is_floating_point() and not dst_idx.is_floating_point()
    _, H, Dh = k_pool.shape
    assert spec.rotary_dim % 2 == 0 and 0 < spec.rotary_dim <= Dh
    assert spec.inv_freq.numel() == spec.rotary_dim // 2
    for d in (k_delta, v_delta):
        if d is not None:
            assert d.A.dim() == 2 and d.rows == src_idx.numel(), "delta A must be [T, r]"
            assert d.cols == H * Dh, "delta B must be [r, kv_heads * head_dim]"


def kv_correct_reference(
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    src_idx: torch.Tensor,
    dst_idx: torch.Tensor,
    pos_delta: Shift,
    spec: RopeSpec,
    k_delta: Optional[LowRank] = None,
    v_delta: Optional[LowRank] = None,
    delta_pos: Optional[Shift] = None,
) -> None:
    """Torch reference of ``kv_correct`` (same contract; also tolerates dst overlapping src)."""
    _check(k_pool, v_pool, src_idx, dst_idx, spec, k_delta, v_delta)
    T, (_, H, Dh) = src_idx.numel(), k_pool.shape
    src, dst = src_idx.long(), dst_idx.long()
    k = shift_keys(k_pool[src].float(), _shift_vector(pos_delta, T, "cpu"), spec)  # [T, H, Dh]
    v = v_pool[src].float()
    if k_delta is not None:
        dk = k_delta.reconstruct().reshape(T, H, Dh)
        k = k + shift_keys(dk, _shift_vector(delta_pos, T, "cpu"), spec)
    if v_delta is not None:
        v = v + v_delta.reconstruct().reshape(T, H, Dh)
    k_pool[dst] = k.to(k_pool.dtype)
    v_pool[dst] = v.to(v_pool.dtype)


if triton is not None:

    @triton.jit
    def _kv_correct_kernel(
        k_pool,
        v_pool,
        src_idx,
        dst_idx,
        cos_k,
        sin_k,
        cos_d,
        sin_d,  # [T, HALF] float32
        ka,
        kb,
        va,
        vb,  # A [T, R], B [R, H * Dh]
        stride_row,
        stride_head,
        stride_ka,
        stride_kb,
        stride_va,
        stride_vb,
        Dh,
        HALF,
        RK,
        RV,
        IS_NEOX: tl.constexpr,
        HAS_KD: tl.constexpr,
        HAS_VD: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_R: tl.constexpr,
    ):
        t = tl.program_id(0)
        h = tl.program_id(1)
        src = tl.load(src_idx + t).to(tl.int64)
        dst = tl.load(dst_idx + t).to(tl.int64)
        d = tl.arange(0, BLOCK_D)
        dmask = d < Dh
        rot = d < 2 * HALF
        if IS_NEOX:  # pairs (i, i + HALF)
            low = d < HALF
            partner = tl.where(low, d + HALF, d - HALF)
            sign = tl.where(low, -1.0, 1.0)
            fidx = tl.where(low, d, d - HALF)
        else:  # pairs (2i, 2i + 1)
            even = (d % 2) == 0
            partner = tl.where(even, d + 1, d - 1)
            sign = tl.where(even, -1.0, 1.0)
            fidx = d // 2
        partner = tl.where(rot, partner, d)
        fidx = tl.where(rot, fidx, 0)
        rmask = dmask & rot

        src_off = src * stride_row + h * stride_head
        dst_off = dst * stride_row + h * stride_head
        x = tl.load(k_pool + src_off + d, mask=dmask, other=0.0).to(tl.float32)
        xp = tl.load(k_pool + src_off + partner, mask=rmask, other=0.0).to(tl.float32)
        c = tl.load(cos_k + t * HALF + fidx, mask=rmask, other=1.0)
        s = tl.load(sin_k + t * HALF + fidx, mask=rmask, other=0.0)
        k_out = x * c + sign * xp * s  # [BLOCK_D]; c = 1, s = 0 on pass-through channels

        if HAS_KD:
            dk = tl.zeros((BLOCK_D,), dtype=tl.float32)
            dkp = tl.zeros((BLOCK_D,), dtype=tl.float32)
            for r0 in range(0, RK, BLOCK_R):
                r = r0 + tl.arange(0, BLOCK_R)
                a = tl.load(ka + t * stride_ka + r, mask=r < RK, other=0.0).to(tl.float32)
                bmask = (r[:, None] < RK) & dmask[None, :]
                brow = kb + r[:, None] * stride_kb + h * Dh
                b = tl.load(brow + d[None, :], mask=bmask, other=0.0).to(tl.float32)
                bp = tl.load(brow + partner[None, :], mask=bmask, other=0.0).to(tl.float32)
                dk += tl.sum(a[:, None] * b, axis=0)
                dkp += tl.sum(a[:, None] * bp, axis=0)
            cd = tl.load(cos_d + t * HALF + fidx, mask=rmask, other=1.0)
            sd = tl.load(sin_d + t * HALF + fidx, mask=rmask, other=0.0)
            k_out += dk * cd + sign * dkp * sd
        tl.store(k_pool + dst_off + d, k_out.to(k_pool.dtype.element_ty), mask=dmask)

        v = tl.load(v_pool + src_off + d, mask=dmask, other=0.0).to(tl.float32)
        if HAS_VD:
            for r0 in range(0, RV, BLOCK_R):
                r = r0 + tl.arange(0, BLOCK_R)
                a = tl.load(va + t * stride_va + r, mask=r < RV, other=0.0).to(tl.float32)
                bmask = (r[:, None] < RV) & dmask[None, :]
                b = tl.load(vb + r[:, None] * stride_vb + h * Dh + d[None, :], mask=bmask, other=0.0)
                v += tl.sum(a[:, None] * b.to(tl.float32), axis=0)
        tl.store(v_pool + dst_off + d, v.to(v_pool.dtype.element_ty), mask=dmask)


def _cos_sin(shift: Optional[Shift], T: int, spec: RopeSpec, device):
    ang = _shift_vector(shift, T, device)[:, None] * spec.inv_freq.to(device, torch.float64)[None, :]
    return ang.cos().float().contiguous(), ang.sin().float().contiguous()


def kv_correct_triton(
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    src_idx: torch.Tensor,
    dst_idx: torch.Tensor,
    pos_delta: Shift,
    spec: RopeSpec,
    k_delta: Optional[LowRank] = None,
    v_delta: Optional[LowRank] = None,
    delta_pos: Optional[Shift] = None,
) -> None:
    """Launch the Triton kernel (same contract as ``kv_correct_reference``; dst must not overlap src)."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    _check(k_pool, v_pool, src_idx, dst_idx, spec, k_delta, v_delta)
    assert k_pool.stride() == v_pool.stride(), "K and V pools must share strides"
    assert k_pool.stride(-1) == 1, "head_dim must be contiguous"
    assert src_idx.is_contiguous() and dst_idx.is_contiguous()
    T, (_, H, Dh) = src_idx.numel(), k_pool.shape
    if T == 0:
        return
    dev = k_pool.device
    cos_k, sin_k = _cos_sin(pos_delta, T, spec, dev)
    cos_d, sin_d = _cos_sin(delta_pos, T, spec, dev) if k_delta is not None else (cos_k, sin_k)

    def factors(f: Optional[LowRank]):
        if f is None:
            return k_pool, k_pool, 0, 0, 0
        A, B = f.A.contiguous(), f.B.contiguous()
        assert A.device == dev and B.device == dev
        return A, B, A.stride(0), B.stride(0), f.rank

    ka, kb, s_ka, s_kb, rk = factors(k_delta)
    va, vb, s_va, s_vb, rv = factors(v_delta)
    _kv_correct_kernel[(T, H)](
        k_pool,
        v_pool,
        src_idx,
        dst_idx,
        cos_k,
        sin_k,
        cos_d,
        sin_d,
        ka,
        kb,
        va,
        vb,
        k_pool.stride(0),
        k_pool.stride(1),
        s_ka,
        s_kb,
        s_va,
        s_vb,
        Dh,
        spec.rotary_dim // 2,
        rk,
        rv,
        IS_NEOX=spec.is_neox,
        HAS_KD=k_delta is not None,
        HAS_VD=v_delta is not None,
        BLOCK_D=triton.next_power_of_2(Dh),
        BLOCK_R=16,
    )


def kv_correct(
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    src_idx: torch.Tensor,
    dst_idx: torch.Tensor,
    pos_delta: Shift,
    spec: RopeSpec,
    k_delta: Optional[LowRank] = None,
    v_delta: Optional[LowRank] = None,
    delta_pos: Optional[Shift] = None,
) -> None:
    """Triton on CUDA when available, the torch reference elsewhere (see the module docstring)."""
    fn = kv_correct_triton if (triton is not None and k_pool.is_cuda) else kv_correct_reference
    fn(k_pool, v_pool, src_idx, dst_idx, pos_delta, spec, k_delta, v_delta, delta_pos)
