"""GraphFlow baseline (Li et al., 2026a), as the KVCMAS paper implements it (appendix B.1).

A correction is constructed once per recurring relation and reused without online matching.
A relation is (slot, source agent, target agent); the slot name stands for the slot kind: it names
one placeholder of the workflow template (e.g. ``user_question``, ``agent_2_current``) whose
content changes per request while its position in the workflow recurs.
The first dense fallback on a relation stores Delta_{j<-ref} = C_j - C_ref (full, or low-rank when
``rank`` is set); later segments of that relation get C_ref + Delta on the covered prefix
min(S, stored length) and the source agent's aligned cache beyond it (as KVCMAS treats rows no
anchor covers: the context-free reference uncorrected is far worse than the source). Later
observations do not update it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from typing import ClassVar, Dict, Optional, Tuple

import torch

from sglang_kvshare.correction.base import CorrectionResult, Corrector, KVDelta, apply_delta, check_pair
from sglang_kvshare.lowrank import Factor, factorize


@dataclass(frozen=True)
class GraphFlowConfig:
    """rank: None stores each delta full-dimensional, an int stores a truncated SVD.
    factor_dtype: storage dtype (None: the cache dtype)."""

    rank: Optional[int] = None
    factor_dtype: Optional[torch.dtype] = None


class GraphFlowCorrector(Corrector):
    name: ClassVar[str] = "graphflow"
    chained: ClassVar[bool] = False
    needs_reference: ClassVar[bool] = True
    default_config: ClassVar[GraphFlowConfig] = GraphFlowConfig()

    def __init__(self, config: Optional[GraphFlowConfig] = None, **overrides) -> None:
        self.config = replace(config or self.default_config, **overrides)
        self._relations: Dict[Tuple[str, str, str], Tuple[Factor, Factor]] = {}
        self._counts: Counter = Counter()

    def correct(
        self, slot, source_agent, target_agent, source, reference=None, materialize=True, tau=None, block_size=None
    ) -> CorrectionResult:
        if reference is None:
            raise ValueError("graphflow needs the context-free reference cache")
        self._counts["num_correct"] += 1
        rel = self._relations.get((slot, source_agent, target_agent))
        if rel is None or reference.seq_len == 0:
            self._counts["rejected_no_relation"] += 1
            return CorrectionResult.reject("no_relation")
        dk, dv = rel
        m = min(reference.seq_len, dk.rows)
        delta = KVDelta(dk.reconstruct(m), dv.reconstruct(m))
        kv = apply_delta(reference, source, delta, m) if materialize else None
        self._counts["num_accepted"] += 1
        return CorrectionResult(True, kv, None, 0, m, "accepted", delta=delta)

    def prepare(self, slot, source_agent, target_agent, source, target, reference=None):
        if reference is None:
            raise ValueError("graphflow needs the context-free reference cache")
        check_pair(reference, target, "graphflow.observe")
        dtype = self.config.factor_dtype or reference.k.dtype
        return (slot, source_agent, target_agent), (
            factorize(target.k.float() - reference.k.float(), self.config.rank, dtype),
            factorize(target.v.float() - reference.v.float(), self.config.rank, dtype),
        )

    def record(self, prepared) -> None:
        key, factors = prepared
        if key not in self._relations:
            self._relations[key] = factors
            self._counts["num_inserted"] += 1

    def state_dict(self) -> dict:
        from sglang_kvshare.correction.store import factor_state

        return {
            "relations": [[list(key), factor_state(dk), factor_state(dv)] for key, (dk, dv) in self._relations.items()]
        }

    def load_state_dict(self, state: dict) -> int:
        from sglang_kvshare.correction.store import factor_from_state

        n = 0
        for key, dk, dv in state["relations"]:
            if tuple(key) not in self._relations:
                self._relations[tuple(key)] = (factor_from_state(dk), factor_from_state(dv))
                n += 1
        return n

    def nbytes(self) -> int:
        return sum(dk.nbytes + dv.nbytes for dk, dv in self._relations.values())

    def stats(self) -> dict:
        out = dict(self._counts)
        out.update(name=self.name, num_relations=len(self._relations), nbytes=self.nbytes())
        return out
