"""Truncated-SVD factors of KV matrices (KVCMAS eq. 7) and their byte accounting.

A matrix Z [L, D] (one layer's keys or values of a segment, or a delta between two of them) is
stored as A = U_r Sigma_r [L, r] and B = R_r^T [r, D], so Z ~= A @ B. Leading batch dimensions
(e.g. layers: Z [n_layers, L, D]) are allowed everywhere and factorised independently.
SVD and reconstruction run in float32 whatever the storage dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch


@dataclass(frozen=True)
class LowRank:
    """Low-rank factors Z ~= A @ B. Immutable; nobody mutates A or B after construction.

    A: [..., L, r], B: [..., r, D] with equal leading dims, same device and dtype.
    """

    A: torch.Tensor
    B: torch.Tensor

    def __post_init__(self) -> None:
        if self.A.dim() < 2 or self.A.dim() != self.B.dim():
            raise ValueError(
                f"A {tuple(self.A.shape)} and B {tuple(self.B.shape)} must be [..., L, r], [..., r, D]"
            )
        if self.A.shape[:-2] != self.B.shape[:-2] or self.A.shape[-1] != self.B.shape[-2]:
            raise ValueError(f"A {tuple(self.A.shape)} and B {tuple(self.B.shape)} do not chain")

    @property
    def rows(self) -> int:
        """L, the number of rows (tokens) of the represented matrix."""
        return self.A.shape[-2]

    @property
    def rank(self) -> int:
        return self.A.shape[-1]

    @property
    def cols(self) -> int:
        return self.B.shape[-1]

    @property
    def nbytes(self) -> int:
        """Bytes held by the two factors."""
        return self.A.numel() * self.A.element_size() + self.B.numel() * self.B.element_size()

    def __getitem__(self, index) -> "LowRank":
        """Select along the leading (batch) dimensions only, e.g. ``f[layer]``."""
        return LowRank(self.A[index], self.B[index])

    def reconstruct(self, num_rows: Optional[int] = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A[..., :num_rows, :] @ B -> [..., num_rows, D] (a new tensor, computed in float32)."""
        a = self.A if num_rows is None else self.A[..., :num_rows, :]
        return (a.float() @ self.B.float()).to(dtype)


@dataclass(frozen=True)
class Dense:
    """A matrix stored uncompressed, with the same interface as ``LowRank`` (Z: [..., L, D])."""

    Z: torch.Tensor

    @property
    def rows(self) -> int:
        return self.Z.shape[-2]

    @property
    def cols(self) -> int:
        return self.Z.shape[-1]

    @property
    def nbytes(self) -> int:
        return self.Z.numel() * self.Z.element_size()

    def __getitem__(self, index) -> "Dense":
        return Dense(self.Z[index])

    def reconstruct(self, num_rows: Optional[int] = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        z = self.Z if num_rows is None else self.Z[..., :num_rows, :]
        return z.to(dtype, copy=True)


Factor = Union[LowRank, Dense]


def truncated_svd(Z: torch.Tensor, rank: int, dtype: Optional[torch.dtype] = None) -> LowRank:
    """Rank-``rank`` truncated SVD of Z [..., L, D]: A = U_r Sigma_r, B = R_r^T (KVCMAS eq. 7).

    ``rank`` is clipped to min(L, D), so a full-rank request reconstructs Z exactly (up to float32
    rounding). Factors are stored in ``dtype`` (default: Z.dtype). Matrices of a batch are
    decomposed one at a time to bound the transient memory to one matrix's SVD. Z is not mutated.
    """
    if Z.dim() < 2:
        raise ValueError(f"Z must be [..., L, D], got {tuple(Z.shape)}")
    if rank < 1:
        raise ValueError(f"rank must be >= 1, got {rank}")
    L, D = Z.shape[-2:]
    r = min(rank, L, D)
    dtype = dtype or Z.dtype
    lead = Z.shape[:-2]
    flat = Z.reshape(-1, L, D)
    A = torch.empty((flat.shape[0], L, r), dtype=dtype, device=Z.device)
    B = torch.empty((flat.shape[0], r, D), dtype=dtype, device=Z.device)
    for i in range(flat.shape[0]):
        U, S, Vh = torch.linalg.svd(flat[i].float(), full_matrices=False)
        A[i] = U[:, :r] * S[:r]
        B[i] = Vh[:r]
    return LowRank(A.reshape(*lead, L, r), B.reshape(*lead, r, D))


def factorize(Z: torch.Tensor, rank: Optional[int], dtype: Optional[torch.dtype] = None) -> Factor:
    """``truncated_svd(Z, rank)`` when ``rank`` is set and the factors are smaller than Z
    (r (L + D) < L D), else a ``Dense`` copy of Z (for short segments the factors would be
    lossless and larger)."""
    L, D = Z.shape[-2], Z.shape[-1]
    if rank is None or rank * (L + D) >= L * D:
        return Dense(Z.to(dtype or Z.dtype, copy=True))
    return truncated_svd(Z, rank, dtype)


def effective_rank(Z: torch.Tensor, energy: float = 0.9) -> Union[int, torch.Tensor]:
    """Smallest rank whose leading singular values retain ``energy`` of sum(sigma^2).

    Z: [L, D] -> int; Z: [..., L, D] -> int64 tensor of shape [...]. A zero matrix has rank 0.
    """
    if not 0.0 < energy <= 1.0:
        raise ValueError(f"energy must be in (0, 1], got {energy}")
    S = torch.linalg.svdvals(Z.double())
    power = S.square()
    total = power.sum(-1, keepdim=True)
    cum = power.cumsum(-1)
    # the relative slack keeps energy=1.0 from counting float noise as extra rank
    ranks = (cum < energy * total * (1 - 1e-12)).sum(-1) + 1
    ranks = torch.where(total.squeeze(-1) > 0, ranks, torch.zeros_like(ranks))
    return int(ranks) if Z.dim() == 2 else ranks
