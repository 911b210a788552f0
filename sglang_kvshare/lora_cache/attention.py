"""Flash-LoRA-Attention, torch reference (one sequence, one agent).

Value LR (QV and QKVO adapters): with ``P = softmax(q K^T * scale)`` per head,
    out = P V_base + (P LR_v) B_v
so the ``[Tk, kv_dim]`` value delta ``LR_v B_v`` is never formed; ``P LR_v`` is ``[Tq, r]`` per
head.

Key LR (QKVO adapters): the key cache holds post-RoPE base keys ``K_base = RoPE(X W_k)``; the
agent's key is ``K = K_base + RoPE(LR_k B_k)`` with the rotation at each key's own position
(RoPE is linear). Because the rotation sits between ``B_k`` and ``q``, the key delta is expanded
from rank r and rotated before the scores are formed (``expand_key_lr``): here for the whole
sequence, tile by tile in the Triton kernel (``sglang_kvshare/kernels/flash_lora_attention.py``). The agent's q
and o adapters act on its own new tokens only (query side, output side) and need no cache.

GQA: query head ``h`` reads KV head ``h // (Hq // Hkv)`` and, for the delta, columns
``[g * D, (g + 1) * D)`` of ``B``. All math runs in float32; outputs have ``q.dtype``.
"""

from __future__ import annotations

from typing import Optional

import torch

from sglang_kvshare.lora_cache.base import AttentionSpan
from sglang_kvshare.rope.align import RopeSpec, shift_keys


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape:
        raise ValueError(
            f"need q [Tq, Hq, D], k/v [Tk, Hkv, D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.shape[2] != k.shape[2] or q.shape[1] % k.shape[1]:
        raise ValueError(f"head dims differ or Hq={q.shape[1]} is not a multiple of Hkv={k.shape[1]}")


def attention_probs(
    q: torch.Tensor, k: torch.Tensor, scale: Optional[float] = None, causal: bool = True, q_start: Optional[int] = None
) -> torch.Tensor:
    """Softmax probabilities ``[Hkv, G, Tq, Tk]`` (float32) of q [Tq, Hq, D] over k [Tk, Hkv, D],
    G = Hq // Hkv; see ``AttentionSpan`` for ``causal`` / ``q_start``."""
    Tq, Hq, D = q.shape
    Tk, Hkv, _ = k.shape
    scale = D**-0.5 if scale is None else scale
    qh = q.float().view(Tq, Hkv, Hq // Hkv, D).permute(1, 2, 0, 3)  # [Hkv, G, Tq, D]
    scores = torch.einsum("hgqd,khd->hgqk", qh, k.float()) * scale
    mask = AttentionSpan(Tq, Tk, q_start, causal).mask(q.device)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1)


def flash_lora_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v_base: torch.Tensor,
    lr: Optional[torch.Tensor],
    B_v: Optional[torch.Tensor],
    scale: Optional[float] = None,
    causal: bool = True,
    q_start: Optional[int] = None,
) -> torch.Tensor:
    """``P V_base + (P LR) B_v`` without materialising ``LR B_v``.

    q [Tq, Hq, D]; k, v_base [Tk, Hkv, D] (k already the agent's key: post-RoPE base, plus the
    expanded key delta for QKVO); lr [Tk, r] = the agent's ``s X A_v^T`` (LR cache); B_v
    [r, Hkv * D]. ``lr``/``B_v`` None: base attention only. Returns [Tq, Hq, D] in q.dtype.
    """
    _check(q, k, v_base)
    Tq, Hq, D = q.shape
    Tk, Hkv, _ = k.shape
    P = attention_probs(q, k, scale, causal, q_start)  # [Hkv, G, Tq, Tk]
    out = torch.einsum("hgqk,khd->hgqd", P, v_base.float())
    if lr is not None:
        r = lr.shape[1]
        if lr.shape[0] != Tk or B_v.shape != (r, Hkv * D):
            raise ValueError(f"need lr [{Tk}, r] and B_v [r, {Hkv * D}], got {tuple(lr.shape)}, {tuple(B_v.shape)}")
        p_lr = torch.einsum("hgqk,kr->hgqr", P, lr.float())  # [Hkv, G, Tq, r]
        B_h = B_v.float().view(r, Hkv, D).permute(1, 0, 2)  # [Hkv, r, D]
        out = out + torch.einsum("hgqr,hrd->hgqd", p_lr, B_h)
    return out.permute(2, 0, 1, 3).reshape(Tq, Hq, D).to(q.dtype)


def expand_key_lr(
    lr_k: torch.Tensor, B_k: torch.Tensor, num_kv_heads: int, positions: torch.Tensor, rope: RopeSpec
) -> torch.Tensor:
    """Post-RoPE key delta ``RoPE(LR_k B_k)`` [Tk, Hkv, D] (lr_k.dtype) for keys at ``positions``
    [Tk] (int). lr_k [Tk, r] (scaling folded in), B_k [r, Hkv * D]."""
    Tk = lr_k.shape[0]
    delta = (lr_k.float() @ B_k.float()).view(Tk, num_kv_heads, -1)
    return shift_keys(delta, positions.to(torch.int64), rope).to(lr_k.dtype)


def flash_lora_attention_qkvo(
    q: torch.Tensor,
    k_base: torch.Tensor,
    v_base: torch.Tensor,
    lr_v: torch.Tensor,
    B_v: torch.Tensor,
    lr_k: torch.Tensor,
    B_k: torch.Tensor,
    rope: RopeSpec,
    key_positions: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    causal: bool = True,
    q_start: Optional[int] = None,
) -> torch.Tensor:
    """Flash-LoRA-Attention with a key LR cache (QKVO adapters).

    k_base [Tk, Hkv, D] post-RoPE base keys; lr_k [Tk, r] the agent's key LR, B_k [r, Hkv * D];
    key_positions [Tk] RoPE positions of the keys (default ``arange(Tk)``). The key delta enters
    as ``K = K_base + RoPE(lr_k B_k)`` (expanded, see module docstring); values as in
    ``flash_lora_attention``. q must already carry RoPE (and the agent's q adapter).
    """
    Tk, Hkv, _ = k_base.shape
    pos = torch.arange(Tk, device=k_base.device) if key_positions is None else key_positions
    k = k_base.float() + expand_key_lr(lr_k, B_k, Hkv, pos, rope).float()
    return flash_lora_attention(q, k, v_base, lr_v, B_v, scale, causal, q_start)


def lora_attention_naive(
    q: torch.Tensor,
    k: torch.Tensor,
    v_base: torch.Tensor,
    lr: Optional[torch.Tensor],
    B_v: Optional[torch.Tensor],
    scale: Optional[float] = None,
    causal: bool = True,
    q_start: Optional[int] = None,
) -> torch.Tensor:
    """Ordinary LoRA attention for tests: materialises ``V = V_base + LR B_v`` [Tk, Hkv, D], repeats
    KV heads for GQA and runs softmax attention. Same contract as ``flash_lora_attention``."""
    _check(q, k, v_base)
    Tq, Hq, D = q.shape
    Tk, Hkv, _ = k.shape
    v = v_base.float()
    if lr is not None:
        v = v + (lr.float() @ B_v.float()).view(Tk, Hkv, D)
    G = Hq // Hkv
    kr = k.float().repeat_interleave(G, dim=1)  # [Tk, Hq, D]
    vr = v.repeat_interleave(G, dim=1)
    scale = D**-0.5 if scale is None else scale
    scores = torch.einsum("qhd,khd->hqk", q.float(), kr) * scale
    mask = AttentionSpan(Tq, Tk, q_start, causal).mask(q.device)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    out = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), vr)
    return out.to(q.dtype)
