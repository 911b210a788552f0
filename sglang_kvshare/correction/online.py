"""Online anchor-pool correction, shared by KVCMAS (low-rank, chained) and KVComm (full-rank,
context-free reference): its configuration, the prepared observation and the corrector (pools,
gate decision, observe). One ``AnchorPool`` per slot, process-wide.

For a segment of length S on the edge i -> j (KVCMAS sec. 3.3, appendix A.3):
1. base = the source cache C_i (chained) or the context-free reference C_ref (non-chained).
2. Compatible anchors: those holding a delta for j. Fewer than two -> reject (dense), except a
   pool of capacity 1, which bypasses the gate and uses its sole anchor (appendix C.3).
3. Comparison prefix k = min(S, second-longest compatible anchor length): the longest prefix
   covered by at least two compatible anchors; A_k = compatible anchors of length >= k.
   ``full_coverage`` (KVComm) instead needs two anchors covering all S rows.
4. Gate (eq. 9-11): d_v = sqrt(sum_l ||V[l, :k] - V~_v[l, :k]||_F^2) on VALUE states,
   g = softmax(-d / T), accept iff normalised entropy (log2) <= tau. ``gate_scale`` "relative"
   divides every d_v by the smallest one first (see ``gate.relative_distances``).
   Partial fallback (``correct(..., block_size=B)``, beyond the paper): a segment the gate
   rejects is gated again per block of B rows of the k gated ones (d_v over the block's rows,
   all layers, the same tau); it is accepted when any block is, and the rejected blocks' rows
   are the caller's to recompute. An accepted segment accepts all its blocks.
5. Correction (eq. 8): per layer and token t, w_v[t] = softmax_v(-rms_D(X[t] - X~_v[t]))
   separately for keys and values (the paper: the mean absolute distance; the root mean square
   is computed in the factors' space without reconstructing any anchor, see
   ``FactorBatch.sq_distances``, and ranks anchors alike), X^[t] = X[t] + sum_v w_v[t] Delta_v[t] for t < k. Rows k: are
   the source agent's aligned cache (the caller's ``source``; for chained methods the base
   itself). Layers in ``skip_layers`` are copied uncorrected. Every member of A_k of an accepted
   correction counts one use (the eviction frequency).
6. ``observe`` after a dense fallback: Delta = target - base (eq. 12) joins the anchor of the
   same base instance if one exists (fan-out), else a new anchor (base + delta) is inserted.
   ``observe`` = ``record(prepare(...))``: ``prepare`` does the factorisation (the expensive,
   pure part) and may run on another thread; ``record`` only changes the pools.

The math of steps 4 and 5 (gate distances, the delta estimate), batched over members and
layers, is ``online_math.AnchorPoolMath``, a base of ``AnchorPoolCorrector``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from typing import ClassVar, Dict, List, Optional, Tuple

import torch

from sglang_kvshare.correction.base import CorrectionResult, Corrector, SegmentKV, apply_delta, check_pair
from sglang_kvshare.correction.gate import gate
from sglang_kvshare.correction.online_math import AnchorPoolMath, Edge
from sglang_kvshare.correction.pool import Anchor, AnchorPool, bytes_per_token, fingerprint
from sglang_kvshare.lowrank import Factor, factorize


@dataclass(frozen=True)
class AnchorPoolConfig:
    """Knobs of an online anchor-pool corrector (defaults: KVCMAS, sec. 4.1).

    num_anchors: V, pool capacity per slot. tau: entropy threshold. temperature: T of both
    softmaxes. rank_base / rank_delta: r_C / r_Delta of the truncated SVD, None = stored full.
    num_oldest: eviction candidates (LFU among the oldest). skip_layers: layers never corrected.
    factor_dtype: storage dtype of factors (None: the cache dtype). max_bytes_per_slot: optional
    byte budget of one slot's pool. full_coverage: correct only segments that two anchors cover
    entirely (KVComm), else the covered prefix (KVCMAS). gate_scale: "absolute" (eq. 9 as
    written) or "relative" (distances over the smallest one, see ``gate.relative_distances``).
    gate_temperature: T of the gate softmax (eq. 10; None: ``temperature``). compute_dtype: dtype
    of the inputs of the gate's and the correction's products (``lowrank.FactorBatch``).
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
    full_coverage: bool = False
    gate_scale: str = "absolute"
    gate_temperature: Optional[float] = None
    compute_dtype: torch.dtype = torch.float32


@dataclass
class Observation:
    """A dense fallback, factorised by ``prepare`` and waiting for ``record``.

    base / delta: (keys, values) factors [n_layers, L, D], stored in ``dtype``; raw_delta: the float32 delta (k, v)
    for correctors that keep more than factors (None once recorded)."""

    slot: str
    owner: Optional[str]
    target_agent: str
    edge: Edge
    key: tuple
    base: Tuple[Factor, Factor]
    delta: Tuple[Factor, Factor]
    dtype: torch.dtype
    raw_delta: Optional[Tuple[torch.Tensor, torch.Tensor]] = None


class AnchorPoolCorrector(AnchorPoolMath, Corrector):
    """Online anchor matching with an entropy gate; see the module docstring for the algorithm."""

    name: ClassVar[str] = "anchor_pool"
    chained: ClassVar[bool] = True
    needs_reference: ClassVar[bool] = False
    default_config: ClassVar[AnchorPoolConfig] = AnchorPoolConfig()
    keeps_raw_delta: ClassVar[bool] = False  # ``record`` needs the float32 delta, not only factors

    def __init__(self, config: Optional[AnchorPoolConfig] = None, **overrides) -> None:
        self.config = replace(config or self.default_config, **overrides)
        if self.config.gate_scale not in ("absolute", "relative"):
            raise ValueError(f"gate_scale must be 'absolute' or 'relative', got {self.config.gate_scale!r}")
        self._pools: Dict[str, AnchorPool] = {}
        self._counts: Counter = Counter()

    # ---- queries -------------------------------------------------------------------------
    def pool(self, slot: str) -> Optional[AnchorPool]:
        """The slot's pool (read-only use), or None before its first observation."""
        return self._pools.get(slot)

    def pools(self) -> Dict[str, AnchorPool]:
        """slot -> pool (read-only use)."""
        return self._pools

    def nbytes(self) -> int:
        return sum(p.nbytes for p in self._pools.values())

    def anchors(self) -> List[Tuple[str, Anchor]]:
        """(slot, anchor) of every stored anchor."""
        return [(slot, a) for slot, p in self._pools.items() for a in p.anchors]

    def remove(self, slot: str, anchor: Anchor) -> None:
        """Drop one anchor (budget eviction by the owner of the process-wide budget)."""
        self._pools[slot].anchors.remove(anchor)
        self._counts["num_evicted"] += 1

    def shrink_to(self, max_bytes: int) -> int:
        """Evict anchors, LFU among the oldest of all pools, until the state fits ``max_bytes``;
        returns how many were evicted."""
        from sglang_kvshare.correction.pool import evict_lfu_oldest

        return evict_lfu_oldest([self], max_bytes, self.config.num_oldest)

    def state_dict(self) -> dict:
        """Every pool's anchors as plain values and tensors (``correction.store``)."""
        from sglang_kvshare.correction.store import anchor_state

        return {"pools": {slot: [anchor_state(a) for a in pool.anchors] for slot, pool in self._pools.items()}}

    def load_state_dict(self, state: dict) -> int:
        """Add the anchors of ``state_dict()`` output, oldest first, under this corrector's pool
        capacity; returns how many were added."""
        from sglang_kvshare.correction.store import anchor_from_state

        cfg, n = self.config, 0
        for slot, anchors in state["pools"].items():
            pool = self._pools.setdefault(slot, AnchorPool(cfg.num_anchors, cfg.num_oldest, cfg.max_bytes_per_slot))
            for d in anchors:
                pool.insert(anchor_from_state(d))
                n += 1
        return n

    def stats(self) -> dict:
        out = dict(self._counts)
        out.update(
            name=self.name,
            num_slots=len(self._pools),
            num_anchors=sum(len(p) for p in self._pools.values()),
            nbytes=self.nbytes(),
            compute_dtype=str(self.config.compute_dtype).removeprefix("torch."),
        )
        return out

    # ---- the contract --------------------------------------------------------------------
    def _base(self, source: SegmentKV, reference: Optional[SegmentKV]) -> SegmentKV:
        if self.chained:
            return source
        if reference is None:
            raise ValueError(f"{self.name} needs the context-free reference cache")
        return reference

    def correct(
        self,
        slot,
        source_agent,
        target_agent,
        source,
        reference=None,
        materialize: bool = True,
        tau: Optional[float] = None,
        block_size: Optional[int] = None,
    ) -> CorrectionResult:
        if block_size is not None and block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        base = self._base(source, reference)
        self._counts["num_correct"] += 1
        tau = self.config.tau if tau is None else tau
        edge = (slot, source_agent, target_agent)
        result = self._correct(slot, target_agent, base, source, edge, materialize, tau, block_size)
        self._counts["num_accepted" if result.accepted else f"rejected_{result.reason}"] += 1
        if result.rejected_rows:
            self._counts["num_partial"] += 1
        return result

    def members(self, slot: str, target_agent: str, seq_len: int) -> Tuple[List[Anchor], int, str]:
        """(A_k, k, reason): the anchors that take part for a segment of ``seq_len`` rows; reason
        is "" when they may be gated, else the rejection word."""
        pool = self._pools.get(slot)
        compatible = pool.compatible(target_agent) if pool is not None else []
        if seq_len == 0:
            return [], 0, "empty"
        if len(compatible) == 1 and self.config.num_anchors == 1:
            k = min(seq_len, compatible[0].seq_len)
            return compatible, k, "" if not self.config.full_coverage or k == seq_len else "coverage"
        if len(compatible) < 2:
            return compatible, 0, "few_anchors"
        lengths = sorted((a.seq_len for a in compatible), reverse=True)
        k = min(seq_len, lengths[1])
        if self.config.full_coverage and k < seq_len:
            return [a for a in compatible if a.seq_len >= seq_len], 0, "coverage"
        return [a for a in compatible if a.seq_len >= k], k, ""

    def _correct(
        self,
        slot: str,
        target_agent: str,
        base: SegmentKV,
        source: SegmentKV,
        edge: Edge,
        materialize: bool,
        tau: float,
        block_size: Optional[int] = None,
    ) -> CorrectionResult:
        members, k, reason = self.members(slot, target_agent, base.seq_len)
        per_token = bytes_per_token(members, target_agent)
        if reason:
            return CorrectionResult.reject(reason, num_anchors=len(members), anchor_bytes_per_token=per_token)
        sq, dist_v = self._value_distances(base, members, k)
        entropy, blocks = None, ()
        if len(members) >= 2:
            T = self.config.gate_temperature or self.config.temperature
            _, entropy = gate(self._gate_scaled(sq.sqrt()), T)
            if block_size is not None:
                blocks = self._gate_blocks(dist_v, base.dim, block_size, T, tau, entropy <= tau)
            if entropy > tau and not any(b.accepted for b in blocks):
                return CorrectionResult.reject("entropy", entropy, len(members), per_token, blocks)
        delta = self._delta(base, members, target_agent, k, dist_v, edge)
        for a in members:
            a.use_count += 1
        kv = apply_delta(base, source, delta, k) if materialize else None
        reason = "partial" if entropy is not None and entropy > tau else "accepted"  # partial: some blocks
        return CorrectionResult(
            True, kv, entropy, len(members), k, reason, delta=delta, anchor_bytes_per_token=per_token, blocks=blocks
        )

    def prepare(self, slot, source_agent, target_agent, source, target, reference=None) -> Observation:
        base = self._base(source, reference)
        check_pair(base, target, f"{self.name}.observe")
        dtype = self.config.factor_dtype or base.k.dtype
        delta_k = target.k.float() - base.k.float()  # [n_layers, L, D]
        delta_v = target.v.float() - base.v.float()
        return Observation(
            slot=slot,
            owner=source_agent if self.chained else None,
            target_agent=target_agent,
            edge=(slot, source_agent, target_agent),
            key=fingerprint(base),
            base=(self._factorize(base.k, "base", dtype), self._factorize(base.v, "base", dtype)),
            delta=(self._factorize(delta_k, "delta", dtype), self._factorize(delta_v, "delta", dtype)),
            dtype=dtype,
            raw_delta=(delta_k, delta_v) if self.keeps_raw_delta else None,
        )

    def record(self, obs: Observation) -> Anchor:
        """Store an observed delta (eq. 12) in the slot's pool; returns the anchor that holds it
        (new, or the existing anchor of the same base instance)."""
        cfg = self.config
        pool = self._pools.get(obs.slot)
        if pool is None:
            pool = AnchorPool(cfg.num_anchors, cfg.num_oldest, cfg.max_bytes_per_slot)
            self._pools[obs.slot] = pool
        obs.raw_delta = None
        anchor = pool.find(obs.key, obs.owner)
        if anchor is not None:
            anchor.deltas[obs.target_agent] = obs.delta
            self._counts["num_merged"] += 1
            return anchor
        anchor = Anchor(
            base_k=obs.base[0],
            base_v=obs.base[1],
            deltas={obs.target_agent: obs.delta},
            source_agent=obs.owner,
            key=obs.key,
        )
        self._counts["num_inserted"] += 1
        self._counts["num_evicted"] += len(pool.insert(anchor))
        return anchor

    def _factorize(self, Z: torch.Tensor, kind: str, dtype: torch.dtype) -> Factor:
        """Storage form of a base ("base") or delta ("delta") stack [n_layers, L, D]."""
        rank = self.config.rank_base if kind == "base" else self.config.rank_delta
        return factorize(Z, rank, dtype)
