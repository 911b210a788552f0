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
            raise ValueError(f"A {tuple(self.A.shape)} and B {tuple(self.B.shape)} must be [..., L, r], [..., r, D]")
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
    rounding). A is stored in ``dtype`` (default: Z.dtype), B in float32 with orthonormal rows.
    Z is not mutated.

    Tall matrices (L > D, every long segment: D is kv_heads * head_dim) are decomposed through
    their D x D Gram matrix, all matrices of the batch at once: R_r = the top-r eigenvectors of
    Z^T Z (``torch.linalg.eigh`` in float64), A = Z R_r. This is the same factorisation as the SVD
    (B has orthonormal rows, A's columns have norms sigma_1..sigma_r) at a third of its cost, the
    part that runs off the scheduler's critical path on every dense fallback. Wide matrices use
    ``torch.linalg.svd``.
    """
    if Z.dim() < 2:
        raise ValueError(f"Z must be [..., L, D], got {tuple(Z.shape)}")
    if rank < 1:
        raise ValueError(f"rank must be >= 1, got {rank}")
    L, D = Z.shape[-2:]
    r = min(rank, L, D)
    dtype = dtype or Z.dtype
    z = Z.float()
    if L > D:
        gram = (z.transpose(-1, -2) @ z).double()  # [..., D, D]
        _, vecs = torch.linalg.eigh(gram)  # ascending eigenvalues
        B = vecs[..., -r:].flip(-1).transpose(-1, -2).float()  # [..., r, D]
        A = z @ B.transpose(-1, -2)  # [..., L, r]
    else:
        U, S, Vh = torch.linalg.svd(z, full_matrices=False)
        A, B = U[..., :r] * S[..., None, :r], Vh[..., :r, :]
    # NOTE: B ([r, D], small next to A) stays float32 whatever ``dtype``: its rows stay
    # orthonormal, which ``FactorBatch.sq_distances`` relies on.
    return LowRank(A.to(dtype).contiguous(), B.contiguous())


def randomized_svd(
    Z: torch.Tensor, rank: int, dtype: Optional[torch.dtype] = None, oversample: int = 8, niter: int = 1, seed: int = 0
) -> LowRank:
    """``truncated_svd(Z, rank)`` approximated by ``torch.svd_lowrank`` (a randomized range
    finder with ``oversample`` extra columns and ``niter`` power iterations, seeded for
    repeatability without touching the global generator): about 3x faster on a 2K x 192 matrix
    at rank 8, within 0.2 % of the optimal error. Exact (``truncated_svd``) when rank +
    oversample reaches min(L, D)."""
    L, D = Z.shape[-2:]
    if rank + oversample >= min(L, D):
        return truncated_svd(Z, rank, dtype)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        U, S, V = torch.svd_lowrank(Z.float(), q=rank + oversample, niter=niter)
    A = U[..., :rank] * S[..., None, :rank]
    return LowRank(A.to(dtype or Z.dtype).contiguous(), V[..., :rank].transpose(-1, -2).contiguous())


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


def native_bfloat16(device: Union[str, torch.device] = "cpu") -> bool:
    """Whether bfloat16 matrix products are native (faster than float32) on ``device``: CUDA
    with bfloat16 support, or a CPU whose oneDNN has bfloat16 kernels (AVX512-BF16 or AMX)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return False


class FactorBatch:
    """N factors of one shape [n_layers, >= num_rows, D] used together.

    The low-rank members (from ``truncated_svd``: B with orthonormal rows) are concatenated along
    the rank, A_cat = [A_1 | ... | A_N] ([c, k, N r]) and B_cat = [B_1; ...; B_N] ([c, N r, D]),
    zero-padded to a common rank, so reconstructing, measuring or mixing all of them over a
    block of layers is one batched product, not a loop over layers and members. Dense members
    are stacked apart. All results are float32. Reads the factors, never mutates them.

    ``compute_dtype`` bfloat16 runs those products in bfloat16 (inputs and results rounded to
    it, the sums inside a product kept in float32 by oneDNN / cuBLAS; everything around the
    products stays float32): on CPUs with native bfloat16 dot products (AVX512-BF16, AMX) and on
    CUDA they are 2-3x faster than float32 (``native_bfloat16``).
    """

    def __init__(self, factors: "list[Factor]", num_rows: int, compute_dtype: torch.dtype = torch.float32) -> None:
        if compute_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"compute_dtype must be float32 or bfloat16, got {compute_dtype}")
        self.factors, self.num_rows, self.compute_dtype = list(factors), num_rows, compute_dtype
        self.low = [i for i, f in enumerate(self.factors) if isinstance(f, LowRank)]
        self.dense = [i for i, f in enumerate(self.factors) if not isinstance(f, LowRank)]
        self.rank = max((self.factors[i].rank for i in self.low), default=0)

    def __len__(self) -> int:
        return len(self.factors)

    def _low(self, layers: slice):
        """(A_cat [c, k, n r], B_cat [c, n r, D]) of the low-rank members, in ``compute_dtype``."""
        k, r = self.num_rows, self.rank
        As, Bs = [], []
        for i in self.low:
            f = self.factors[i]
            a, b = f.A[layers, :k], f.B[layers]
            if f.rank < r:
                a = torch.cat([a, a.new_zeros(*a.shape[:-1], r - f.rank)], -1)
                b = torch.cat([b, b.new_zeros(*b.shape[:-2], r - f.rank, b.shape[-1])], -2)
            As.append(a)
            Bs.append(b)
        return torch.cat(As, -1).to(self.compute_dtype), torch.cat(Bs, -2).to(self.compute_dtype)

    def _dense(self, layers: slice) -> torch.Tensor:
        return torch.stack([self.factors[i].Z[layers, : self.num_rows] for i in self.dense]).float()

    def _place(self, low: Optional[torch.Tensor], dense: Optional[torch.Tensor]) -> torch.Tensor:
        """Members back in their order along dim 0 from the two groups."""
        parts = [p for p in (low, dense) if p is not None]
        out = torch.cat(parts) if len(parts) > 1 else parts[0]
        order = self.low + self.dense
        return out if order == sorted(order) else out[torch.tensor(order).argsort()]

    def reconstruct(self, layers: slice) -> torch.Tensor:
        """[N, c, k, D]: every member's first k rows in layers ``layers`` (c layers)."""
        low = None
        if self.low:
            A, B = self._low(layers)
            c, k, r = A.shape[0], A.shape[1], self.rank
            n = len(self.low)
            low = (A.view(c, k, n, r).permute(2, 0, 1, 3) @ B.view(c, n, r, -1).transpose(0, 1)).float()
        return self._place(low, self._dense(layers) if self.dense else None)

    def sq_distances(self, x: torch.Tensor, layers: slice) -> torch.Tensor:
        """[N, c, k]: ||x[l, t] - Z_v[l, t]||^2 for every member, x: [c, k, D].

        Low-rank members are never reconstructed: with P = x B^T and orthonormal rows of B,
        ||x - A B||^2 = ||x||^2 - 2 <P, A> + ||A||^2 = ||x||^2 - 2 <P - A / 2, A> per row, so the
        cost is one [k, D] @ [D, N r] product per layer, one elementwise pass over P and the
        memory O(N k r), not O(N k D). P - A / 2 and its product with A stay in ``compute_dtype``;
        the sums of squares and products accumulate in float32 (as precise as the earlier
        ||x||^2 - ||P||^2 + ||P - A||^2, measured against float64, with fewer temporaries)."""
        c, k, _ = x.shape
        low = None
        if self.low:
            A, B = self._low(layers)
            n, r = len(self.low), self.rank
            P = torch.bmm(x.to(A.dtype), B.transpose(1, 2)).view(c, k, n, r)  # [c, k, n, r]
            a = A.view(c, k, n, r)
            pa = P.sub_(a, alpha=0.5).mul_(a).sum(-1, dtype=torch.float32)  # <P, A> - ||A||^2 / 2
            low = (x.float().square().sum(-1)[..., None] - 2.0 * pa).clamp_min_(0.0).permute(2, 0, 1)
        dense = (x.float()[None] - self._dense(layers)).square().sum(-1) if self.dense else None
        return self._place(low, dense)

    def mix(self, weights: torch.Tensor, layers: slice, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """sum_v weights[v, l, t] * Z_v[l, t] -> [c, k, D] float32 (written into ``out`` when
        given); weights: [N, c, k].

        The low-rank part is one product [c, k, N r] @ [c, N r, D] with A = [w_1 A_1 | ...] and
        B = [B_1; ...] (the same form ``kernels.kv_correct`` takes)."""
        total = None
        if self.low:
            A, B = self._low(layers)
            c, k = A.shape[:2]
            n, r = len(self.low), self.rank
            w = weights[self.low].permute(1, 2, 0).to(A.dtype)[..., None]  # [c, k, n, 1]
            total = torch.bmm((A.view(c, k, n, r) * w).view(c, k, n * r), B)  # in compute_dtype
        if self.dense:
            w = weights[self.dense].float()
            d = (w[..., None] * self._dense(layers)).sum(0)
            total = d if total is None else d.add_(total)
        return total.float() if out is None else out.copy_(total)
