"""LR values ``s_k X A_k^T``: what the LR cache stores for each token and agent."""

from __future__ import annotations

from typing import Sequence, Tuple, Union

import torch

from sglang_kvshare.lora_cache.base import LoRAProjection

Scaling = Union[float, Sequence[float], torch.Tensor]


def lr_values(x: torch.Tensor, A: torch.Tensor, scaling: Scaling) -> torch.Tensor:
    """LR values with the LoRA scaling folded in.

    One agent:  x [T, d_in], A [r, d_in], scaling float              -> [T, r]
    All agents: x [T, d_in], A [n_agents, r_max, d_in], scaling [n_agents] (or one float)
                -> [T, n_agents, r_max]; rows of A beyond an agent's rank must be zero.
    Output dtype is x's; one matmul for all agents.
    """
    if x.dim() != 2 or x.shape[-1] != A.shape[-1]:
        raise ValueError(f"x must be [T, {A.shape[-1]}], got {tuple(x.shape)}")
    if A.dim() == 2:
        return (x @ A.t()) * float(scaling)
    if A.dim() != 3:
        raise ValueError(f"A must be [r, d_in] or [n_agents, r_max, d_in], got {tuple(A.shape)}")
    n_agents, r_max, d_in = A.shape
    s = torch.as_tensor(scaling, dtype=x.dtype, device=x.device).reshape(-1)
    if s.numel() not in (1, n_agents):
        raise ValueError(f"scaling must have 1 or {n_agents} entries, got {s.numel()}")
    lr = (x @ A.reshape(n_agents * r_max, d_in).t()).view(-1, n_agents, r_max)
    return lr * s.view(1, -1, 1)


def stack_adapters(
    projections: Sequence[LoRAProjection], max_rank: int = 0
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Zero-padded stacks of several agents' factors of one projection of one layer.

    Returns ``A_all [n, r_max, d_in]``, ``B_all [n, r_max, d_out]`` and ``scaling [n]`` (float32);
    r_max = max(max_rank, largest rank). Padded rows are zero, so they contribute nothing.
    """
    if not projections:
        raise ValueError("no adapters to stack")
    r_max = max([max_rank] + [p.rank for p in projections])
    ref = projections[0]
    A_all = ref.A.new_zeros(len(projections), r_max, ref.A.shape[1])
    B_all = ref.B.new_zeros(len(projections), r_max, ref.B.shape[1])
    for i, p in enumerate(projections):
        A_all[i, : p.rank] = p.A
        B_all[i, : p.rank] = p.B
    scaling = torch.tensor([p.scaling for p in projections], dtype=torch.float32)
    return A_all, B_all, scaling
