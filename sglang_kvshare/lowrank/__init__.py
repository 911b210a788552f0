"""Low-rank (truncated-SVD) factors of KV matrices: A [L, r], B [r, D], reconstruction, bytes."""

from sglang_kvshare.lowrank.factors import (
    Dense,
    Factor,
    FactorBatch,
    LowRank,
    effective_rank,
    factorize,
    native_bfloat16,
    randomized_svd,
    truncated_svd,
)

__all__ = [
    "Dense",
    "Factor",
    "FactorBatch",
    "LowRank",
    "effective_rank",
    "factorize",
    "native_bfloat16",
    "randomized_svd",
    "truncated_svd",
]
