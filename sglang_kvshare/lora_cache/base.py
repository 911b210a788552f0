"""Contracts of the LR cache (PReCache / LRAgent): shapes, layouts and the adapter weights it uses.

An adapted projection of agent ``k`` is ``Y_k = X W_0 + s_k (X A_k^T) B_k`` where ``s_k`` is the
LoRA scaling (``alpha / r``). The KV cache is split into

* the **base cache** ``X W_0`` (post-RoPE keys, values), shared by all agents and stored in the
  ordinary KV pool, and
* the **LR cache** ``LR_k = s_k X A_k^T`` (``[T, r]`` per agent, scaling folded in, as SGLang
  applies it in the A step), stored per agent in an LR pool indexed by the same token slots (the
  engine's ``integration/model/lr_pool.LRCache``; ``tests/lr_cache_sim.py`` simulates it in plain torch).

Value side (QV and QKVO adapters): ``V_k = V_base + LR_k B_k``; attention never materialises the
``[T, kv_dim]`` delta: ``P V_k = P V_base + (P LR_k) B_k`` (Flash-LoRA-Attention).
Key side (QKVO adapters only):
``K_k = RoPE(K_base_pre + LR^K_k B^K_k) = K_base + RoPE(LR^K_k B^K_k)``
(RoPE is linear per position). The rotation sits between ``B^K`` and the dot product with ``q``,
so the key delta is expanded from rank ``r`` to ``[T, Hkv, D]`` and rotated at each key's position
before the scores are formed (tile by tile in the kernel); only values get the associativity trick.

Layout conventions (paper orientation, not PEFT's):
    A: [r, d_in]   (= PEFT ``lora_A.weight``)
    B: [r, d_out]  (= PEFT ``lora_B.weight.T``), d_out = num_kv_heads * head_dim for k/v;
        column ``g * head_dim + d`` is channel ``d`` of KV head ``g``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class LoRAProjection:
    """One adapter's LoRA factors on one projection of one layer.

    A: [r, d_in], B: [r, d_out], same floating dtype; scaling: ``alpha / r`` (folded into LR).
    """

    A: torch.Tensor
    B: torch.Tensor
    scaling: float

    def __post_init__(self):
        if self.A.dim() != 2 or self.B.dim() != 2 or self.A.shape[0] != self.B.shape[0]:
            raise ValueError(
                f"LoRAProjection needs A [r, d_in] and B [r, d_out], got "
                f"{tuple(self.A.shape)} and {tuple(self.B.shape)}"
            )

    @property
    def rank(self) -> int:
        return int(self.A.shape[0])

    @classmethod
    def from_peft(cls, lora_A: torch.Tensor, lora_B: torch.Tensor, scaling: float):
        """From PEFT tensors ``lora_A.weight`` [r, d_in] and ``lora_B.weight`` [d_out, r]."""
        return cls(A=lora_A, B=lora_B.t().contiguous(), scaling=float(scaling))

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """Ordinary LoRA output ``s (x A^T) B``: x [T, d_in] -> [T, d_out] (materialised)."""
        return (x @ self.A.t()) @ self.B * self.scaling


@dataclass(frozen=True)
class AttentionSpan:
    """Which keys a block of queries sees: queries are the last ``q_len`` tokens of a sequence of
    ``kv_len`` tokens, query ``i`` sits at position ``q_start + i`` and (when causal) attends keys
    ``0 .. q_start + i``. ``q_start`` defaults to ``kv_len - q_len`` (prefix length): decode is
    ``q_len == 1``, extend with a cached prefix is ``q_start > 0``."""

    q_len: int
    kv_len: int
    q_start: Optional[int] = None
    causal: bool = True

    @property
    def start(self) -> int:
        return self.kv_len - self.q_len if self.q_start is None else self.q_start

    def mask(self, device=None) -> Optional[torch.Tensor]:
        """[q_len, kv_len] bool, True where attention is allowed (None when not causal)."""
        if not self.causal:
            return None
        qpos = torch.arange(self.q_len, device=device)[:, None] + self.start
        return torch.arange(self.kv_len, device=device)[None, :] <= qpos
