"""Online anchor-pool correction, shared by KVCMAS (low-rank, chained) and KVComm (full-rank,
context-free reference). One ``AnchorPool`` per slot, process-wide.

For a segment of length S on the edge i -> j (KVCMAS sec. 3.3, appendix A.3):
1. base = the source cache C_i (chained) or the context-free reference C_ref (non-chained).
2. Compatible anchors: those holding a delta for j. Fewer than two -> reject (dense), except a
   pool of capacity 1, which bypasses the gate and uses its sole anchor (appendix C.3).
3. Comparison prefix k = min(S, second-longest compatible anchor length): the longest prefix
   covered by at least two compatible anchors; A_k = compatible anchors of length >= k.
4. Gate (eq. 9-11): d_v = sqrt(sum_l ||V[l, :k] - V~_v[l, :k]||_F^2) on VALUE states,
   g = softmax(-d / T), accept iff normalised entropy (log2) <= tau.
5. Correction (eq. 8): per layer and token t, w_v[t] = softmax_v(-mean_D |X[t] - X~_v[t]|)
   separately for keys and values, X^[t] = X[t] + sum_v w_v[t] Delta_v[t] for t < k; rows k:
   are copied from the base. Layers in ``skip_layers`` are copied uncorrected. Every member of
   A_k of an accepted correction counts one use (the eviction frequency).
6. ``observe`` after a dense fallback: Delta = target - base (eq. 12) joins the anchor of the
   same base instance if one exists (fan-out), else a new anchor (base + delta) is inserted.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from typing import ClassVar, Dict, List, Optional, Tuple

import torch

from sglang_kvshare.correction.base import CorrectionResult, Corrector, SegmentKV, check_pair
from sglang_kvshare.correction.gate import gate, token_weights
from sglang_kvshare.correction.pool import Anchor, AnchorPool, fingerprint
from sglang_kvshare.lowrank import Factor, factorize


Edge = Tuple[str, str, str]  # (slot, source agent, target agent)


@dataclass(frozen=True)
class AnchorPoolConfig:
    """Knobs of an online anchor-pool corrector (defaults: KVCMAS, sec. 4.1).

    num_anchors: V, pool capacity per slot. tau: entropy threshold. temperature: T of both
    softmaxes. rank_base / rank_delta: r_C / r_Delta of the truncated SVD, None = stored full.
    num_oldest: eviction candidates (LFU among the oldest). skip_layers: layers never corrected.
    factor_dtype: storage dtype of factors (None: the cache dtype). max_bytes_per_slot: optional
    byte budget of one slot's pool.
    """

    num_anchors: int = 10
    tau: float = 0.3
    temperature: float = 1.0
    rank_base: Optional[int] = 32
    rank_delta: Optional[int] = 32
    num_oldest: int = 5
    skip_layers: Tuple[int, ...] = ()
    factor_dtype: Optional[torch.dtype] = None
    max_bytes_per_slot: Optional[int] = None


class AnchorPoolCorrector(Corrector):
    """Online anchor matching with an entropy gate; see the module docstring for the algorithm."""

    name: ClassVar[str] = "anchor_pool"
    chained: ClassVar[bool] = True
    needs_reference: ClassVar[bool] = False
    default_config: ClassVar[AnchorPoolConfig] = AnchorPoolConfig()

    def __init__(self, config: Optional[AnchorPoolConfig] = None, **overrides) -> None:
        self.config = replace(config or self.default_config, **overrides)
        self._pools: Dict[str, AnchorPool] = {}
        self._counts: Counter = Counter()

    # ---- queries -------------------------------------------------------------------------
    def pool(self, slot: str) -> Optional[AnchorPool]:
        """The slot's pool (read-only use), or None before its first observation."""
        return self._pools.get(slot)

    def nbytes(self) -> int:
        return sum(p.nbytes for p in self._pools.values())

    def shrink_to(self, max_bytes: int) -> int:
        """Evict anchors (LFU among the oldest, from the largest pool first) until the state
        fits ``max_bytes``; returns how many were evicted."""
        evicted = 0
        while self.nbytes() > max_bytes:
            pools = [p for p in self._pools.values() if len(p)]
            if not pools:
                break
            max(pools, key=lambda p: p.nbytes).evict()
            evicted += 1
        self._counts["num_evicted"] += evicted
        return evicted

    def stats(self) -> dict:
        out = dict(self._counts)
        out.update(
            name=self.name,
            num_slots=len(self._pools),
            num_anchors=sum(len(p) for p in self._pools.values()),
            nbytes=self.nbytes(),
        )
        return out

    # ---- the contract --------------------------------------------------------------------
    def _base(self, source: SegmentKV, reference: Optional[SegmentKV]) -> SegmentKV:
        if self.chained:
            return source
        if reference is None:
            raise ValueError(f"{self.name} needs the context-free reference cache")
        return reference

    def correct(self, slot, source_agent, target_agent, source, reference=None) -> CorrectionResult:
        base = self._base(source, reference)
        self._counts["num_correct"] += 1
        result = self._correct(slot, target_agent, base, (slot, source_agent, target_agent))
        self._counts["num_accepted" if result.accepted else f"rejected_{result.reason}"] += 1
        return result

    def _correct(self, slot: str, target_agent: str, base: SegmentKV, edge: Edge) -> CorrectionResult:
        pool = self._pools.get(slot)
        compatible = pool.compatible(target_agent) if pool is not None else []
        S = base.seq_len
        if S == 0:
            return CorrectionResult.reject("empty")
        entropy = None
        if len(compatible) == 1 and self.config.num_anchors == 1:
            members = compatible
            k = min(S, compatible[0].seq_len)
        elif len(compatible) < 2:
            return CorrectionResult.reject("few_anchors", num_anchors=len(compatible))
        else:
            lengths = sorted((a.seq_len for a in compatible), reverse=True)
            k = min(S, lengths[1])
            members = [a for a in compatible if a.seq_len >= k]
            _, entropy = gate(self.gate_distances(base, members, k), self.config.temperature)
            if entropy > self.config.tau:
                return CorrectionResult.reject("entropy", entropy, len(members))
        kv = self.apply(base, members, target_agent, k, edge)
        for a in members:
            a.use_count += 1
        return CorrectionResult(True, kv, entropy, len(members), k, "accepted")

    def observe(self, slot, source_agent, target_agent, source, target, reference=None) -> None:
        base = self._base(source, reference)
        check_pair(base, target, f"{self.name}.observe")
        delta_k = target.k.float() - base.k.float()  # [n_layers, L, D]
        delta_v = target.v.float() - base.v.float()
        self._record(slot, source_agent, target_agent, base, delta_k, delta_v)

    def _record(self, slot, source_agent, target_agent, base, delta_k, delta_v) -> None:
        """Store an observed delta (eq. 12) in the slot's pool."""
        cfg = self.config
        dtype = cfg.factor_dtype or base.k.dtype
        delta = (self._factorize(delta_k, "delta", dtype), self._factorize(delta_v, "delta", dtype))
        pool = self._pools.get(slot)
        if pool is None:
            pool = AnchorPool(cfg.num_anchors, cfg.num_oldest, cfg.max_bytes_per_slot)
            self._pools[slot] = pool
        owner = source_agent if self.chained else None
        key = fingerprint(base)
        anchor = pool.find(key, owner)
        if anchor is not None:
            anchor.deltas[target_agent] = delta
            self._counts["num_merged"] += 1
            return
        anchor = Anchor(
            base_k=self._factorize(base.k, "base", dtype),
            base_v=self._factorize(base.v, "base", dtype),
            deltas={target_agent: delta},
            source_agent=owner,
            key=key,
        )
        self._counts["num_inserted"] += 1
        self._counts["num_evicted"] += len(pool.insert(anchor))

    def _factorize(self, Z: torch.Tensor, kind: str, dtype: torch.dtype) -> Factor:
        """Storage form of a base ("base") or delta ("delta") stack [n_layers, L, D]."""
        rank = self.config.rank_base if kind == "base" else self.config.rank_delta
        return factorize(Z, rank, dtype)

    # ---- the math (public for tests and benchmarks) --------------------------------------
    def gate_distances(self, base: SegmentKV, members: List[Anchor], k: int) -> torch.Tensor:
        """Eq. 9: [N] float32 Frobenius distance over all layers of the first k value rows."""
        sq = torch.zeros(len(members), dtype=torch.float32, device=base.v.device)
        for layer in range(base.num_layers):
            v = base.v[layer, :k].float()  # [k, D]
            for i, a in enumerate(members):
                sq[i] += (v - a.base_v[layer].reconstruct(k)).square().sum()
        return sq.sqrt()

    def apply(
        self, base: SegmentKV, members: List[Anchor], target_agent: str, k: int, edge: Optional[Edge] = None
    ) -> SegmentKV:
        """Corrected copy of ``base``: rows :k get the token-weighted anchor deltas (eq. 8)."""
        out_k, out_v = base.k.clone(), base.v.clone()
        T = self.config.temperature
        for layer in range(base.num_layers):
            if layer in self.config.skip_layers:
                continue
            for which, (x, out) in enumerate(((base.k, out_k), (base.v, out_v))):
                src = x[layer, :k].float()  # [k, D]
                bases = [a.base_k if which == 0 else a.base_v for a in members]
                dist = torch.stack(
                    [(src - b[layer].reconstruct(k)).abs().mean(-1) for b in bases]
                )  # [N, k]
                w = token_weights(dist, T)  # [N, k]
                delta = torch.zeros_like(src)
                for i, a in enumerate(members):
                    delta += w[i, :, None] * a.deltas[target_agent][which][layer].reconstruct(k)
                delta = self._combine(delta, edge, layer, which, k)
                out[layer, :k] = (src + delta).to(out.dtype)
        return SegmentKV(out_k, out_v)

    def _combine(
        self, mix: torch.Tensor, edge: Optional[Edge], layer: int, which: int, k: int
    ) -> torch.Tensor:
        """Final delta [k, D] of one layer (which: 0 keys, 1 values) from the anchor mix."""
        return mix
