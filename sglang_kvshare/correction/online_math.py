"""The math of the online anchor-pool correctors (``correction.online``, steps 4 and 5): the gate
distances on the value states (eq. 9) and the token-weighted delta estimate (eq. 8).

Both run batched over all members and a block of layers at a time (``lowrank.FactorBatch``): one
pass over the value states gives both the gate distances and the value weights.
``AnchorPoolMath`` is a base of ``online.AnchorPoolCorrector`` and reads its ``config`` (an
``online.AnchorPoolConfig``); subclasses change the final delta through ``_combine_``.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from sglang_kvshare.correction.base import GateBlock, KVDelta, SegmentKV, apply_delta
from sglang_kvshare.correction.gate import gate, token_weights
from sglang_kvshare.correction.pool import Anchor
from sglang_kvshare.lowrank import FactorBatch

Edge = Tuple[str, str, str]  # (slot, source agent, target agent)

_LAYERS_PER_BLOCK = 1  # layers batched together (transient memory O(block x N x k x r))


def _blocks(num_layers: int):
    for lo in range(0, num_layers, _LAYERS_PER_BLOCK):
        yield slice(lo, min(lo + _LAYERS_PER_BLOCK, num_layers))


class AnchorPoolMath:
    """Gate distances and delta estimate of an anchor-pool corrector (public for tests and
    benchmarks); ``self.config`` is the corrector's ``AnchorPoolConfig``."""

    def _batch(self, factors: List, k: int) -> FactorBatch:
        """The members' factors of one kind, used together over their first k rows."""
        return FactorBatch(factors, k, self.config.compute_dtype)

    def _value_distances(self, base: SegmentKV, members: List[Anchor], k: int):
        """(sq [N]: eq. 9 squared, dist [N, n_layers, k]: per-token RMS distance of the values)."""
        sq = torch.zeros(len(members), dtype=torch.float32, device=base.v.device)
        dist = torch.empty(len(members), base.num_layers, k, dtype=torch.float32, device=base.v.device)
        bases = self._batch([a.base_v for a in members], k)
        for layers in _blocks(base.num_layers):
            d2 = bases.sq_distances(base.v[layers, :k], layers)  # [N, c, k]
            sq += d2.sum((1, 2))
            dist[:, layers] = (d2 / base.dim).sqrt()
        return sq, dist

    def _gate_scaled(self, d: torch.Tensor) -> torch.Tensor:
        if self.config.gate_scale == "relative":
            from sglang_kvshare.correction.gate import relative_distances

            return relative_distances(d)
        return d

    def _gate_blocks(
        self, dist_v: torch.Tensor, dim: int, block_size: int, T: float, tau: float, segment_accepted: bool
    ) -> Tuple[GateBlock, ...]:
        """Eq. 9-11 on each block of ``block_size`` gated rows (the last one shorter): the block's
        distances to the members over all layers, its entropy and decision (every block is
        accepted when the segment is)."""
        sq_rows = (dist_v.square() * dim).sum(1)  # [N, k]: eq. 9 squared, per row
        blocks = []
        for lo in range(0, sq_rows.shape[1], block_size):
            hi = min(lo + block_size, sq_rows.shape[1])
            _, h = gate(self._gate_scaled(sq_rows[:, lo:hi].sum(1).sqrt()), T)
            blocks.append(GateBlock(lo, hi, h, segment_accepted or h <= tau))
        return tuple(blocks)

    def gate_distances(self, base: SegmentKV, members: List[Anchor], k: int) -> torch.Tensor:
        """Eq. 9: [N] float32 Frobenius distance over all layers of the first k value rows."""
        return self._value_distances(base, members, k)[0].sqrt()

    def apply(
        self, base: SegmentKV, members: List[Anchor], target_agent: str, k: int, edge: Optional[Edge] = None
    ) -> SegmentKV:
        """Corrected copy of ``base``: rows :k get the token-weighted anchor deltas (eq. 8)."""
        _, dist_v = self._value_distances(base, members, k)
        return apply_delta(base, base, self._delta(base, members, target_agent, k, dist_v, edge), k)

    def _delta(
        self,
        base: SegmentKV,
        members: List[Anchor],
        target_agent: str,
        k: int,
        dist_v: torch.Tensor,
        edge: Optional[Edge],
    ) -> KVDelta:
        """The estimated correction of rows :k (eq. 8), [n_layers, k, D] per keys and values."""
        T = self.config.temperature
        n_layers, D = base.num_layers, base.dim
        out_k = torch.empty(n_layers, k, D, dtype=torch.float32, device=base.k.device)
        out_v = torch.empty_like(out_k)
        bases_k = self._batch([a.base_k for a in members], k)
        deltas = [self._batch([a.deltas[target_agent][which] for a in members], k) for which in (0, 1)]
        for layers in _blocks(n_layers):
            dist_k = (bases_k.sq_distances(base.k[layers, :k], layers) / D).sqrt()
            for which, (dist, out) in enumerate(((dist_k, out_k), (dist_v[:, layers], out_v))):
                mix = deltas[which].mix(token_weights(dist, T), layers, out=out[layers])  # [c, k, D]
                self._combine_(mix, edge, layers, which, k)
        for layer in self.config.skip_layers:
            if layer < n_layers:
                out_k[layer] = 0.0
                out_v[layer] = 0.0
        return KVDelta(out_k, out_v)

    def _combine_(self, mix: torch.Tensor, edge: Optional[Edge], layers: slice, which: int, k: int) -> None:
        """Turn the mix [c, k, D] of a block of layers (which: 0 keys, 1 values) into the final
        delta, in place (here: the mix is the delta)."""
