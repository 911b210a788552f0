"""kvcmas_plus: KVCMAS with two changes suggested by measurements on a small GQA model, where a
uniform mean of the anchors' deltas corrected as well as the softmax-weighted one and the delta's
effective rank (90 % energy) was 47-55 of D = 192, above the paper's r = 32.

1. Energy-chosen ranks: each stored stack [n_layers, L, D] keeps the smallest rank retaining
   ``energy`` of sum(sigma^2) in every layer, capped by rank_base / rank_delta.
2. A per-edge systematic delta: M_e, the running position-wise mean of EVERY delta observed on the
   edge e = (slot, source agent, target agent) (also those whose anchors were evicted), stored
   low-rank. On accepted rows covered by M_e the estimate is
       Delta^ = (1 - edge_mix) * sum_v w_v Delta_v + edge_mix * M_e.
   edge_mix = 0 is KVCMAS (with energy ranks); the default 0.5 is untuned.
The gate, pools, eviction and chaining are KVCMAS's unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Dict, Optional

import torch

from sglang_kvshare.correction.online import AnchorPoolConfig, AnchorPoolCorrector
from sglang_kvshare.correction.online_math import Edge
from sglang_kvshare.lowrank import Factor, effective_rank, factorize, truncated_svd


@dataclass(frozen=True)
class KVCMASPlusConfig(AnchorPoolConfig):
    """rank_base / rank_delta are caps here; energy: retained singular-value energy (None: use
    the caps as fixed ranks); edge_mix: weight of the per-edge mean delta in [0, 1]."""

    rank_delta: Optional[int] = 96
    energy: Optional[float] = 0.95
    edge_mix: float = 0.5
    gate_scale: str = "relative"  # as KVCMAS (see correction.kvcmas)
    gate_temperature: Optional[float] = 0.02


@dataclass
class EdgeMean:
    """Running mean of one edge's deltas. k, v: factors [n_layers, L_max, D]; counts: [L_max]
    int64, observations that covered each row. Owned and mutated by its corrector only."""

    k: Factor
    v: Factor
    counts: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes + self.counts.numel() * self.counts.element_size()


class KVCMASPlusCorrector(AnchorPoolCorrector):
    name: ClassVar[str] = "kvcmas_plus"
    chained: ClassVar[bool] = True
    needs_reference: ClassVar[bool] = False
    default_config: ClassVar[KVCMASPlusConfig] = KVCMASPlusConfig()
    keeps_raw_delta: ClassVar[bool] = True  # the edge mean

    def __init__(self, config: Optional[KVCMASPlusConfig] = None, **overrides) -> None:
        super().__init__(config, **overrides)
        if not 0.0 <= self.config.edge_mix <= 1.0:
            raise ValueError(f"edge_mix must be in [0, 1], got {self.config.edge_mix}")
        self._edge_means: Dict[Edge, EdgeMean] = {}

    def edge_mean(self, slot: str, source_agent: str, target_agent: str) -> Optional[EdgeMean]:
        return self._edge_means.get((slot, source_agent, target_agent))

    def nbytes(self) -> int:
        return super().nbytes() + sum(m.nbytes for m in self._edge_means.values())

    def stats(self) -> dict:
        out = super().stats()
        out["num_edges"] = len(self._edge_means)
        return out

    def _factorize(self, Z: torch.Tensor, kind: str, dtype: torch.dtype) -> Factor:
        cap = self.config.rank_base if kind == "base" else self.config.rank_delta
        if cap is None or self.config.energy is None:
            return factorize(Z, cap, dtype)
        ranks = effective_rank(Z.float(), self.config.energy)
        rank = int(ranks.max()) if isinstance(ranks, torch.Tensor) else ranks
        return truncated_svd(Z, max(1, min(cap, rank)), dtype)

    def record(self, obs):
        delta_k, delta_v = obs.raw_delta
        anchor = super().record(obs)
        edge = obs.edge
        dtype = obs.dtype
        n_layers, L, D = delta_k.shape
        old = self._edge_means.get(edge)
        rows = L if old is None else max(L, old.k.rows)
        counts = torch.zeros(rows, dtype=torch.int64, device=delta_k.device)
        means = []
        for which, delta in enumerate((delta_k, delta_v)):
            m = torch.zeros(n_layers, rows, D, dtype=torch.float32, device=delta.device)
            if old is not None:
                m[:, : old.k.rows] = (old.k, old.v)[which].reconstruct()
            means.append(m)
        if old is not None:
            counts[: old.counts.numel()] = old.counts
        counts[:L] += 1
        scale = counts[:L].float()[None, :, None]
        for m, delta in zip(means, (delta_k, delta_v)):
            m[:, :L] += (delta - m[:, :L]) / scale
        self._edge_means[edge] = EdgeMean(
            self._factorize(means[0], "delta", dtype), self._factorize(means[1], "delta", dtype), counts
        )
        return anchor

    def _combine_(self, mix, edge, layers, which, k) -> None:
        mean = self._edge_means.get(edge) if edge is not None else None
        lam = self.config.edge_mix
        if mean is None or lam == 0.0:
            return
        n = min(k, mean.k.rows)
        mix[:, :n] = (1.0 - lam) * mix[:, :n] + lam * (mean.k, mean.v)[which][layers].reconstruct(n)
