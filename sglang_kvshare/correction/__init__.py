"""Cross-agent KV cache correction methods behind one contract (``base.Corrector``).

Registry names: ``kvcmas`` (the paper, chained low-rank anchors), ``kvcmas_nonchained``
(its context-free-reference ablation), ``kvcmas_plus`` (energy-chosen ranks + per-edge mean
delta; ours, not in the paper), ``kvcomm`` and ``graphflow`` (baselines).
"""

from typing import Dict, List, Type

from sglang_kvshare.correction.base import CorrectionResult, Corrector, SegmentKV
from sglang_kvshare.correction.graphflow import GraphFlowConfig, GraphFlowCorrector
from sglang_kvshare.correction.kvcmas import KVCMASCorrector, KVCMASNonChainedCorrector
from sglang_kvshare.correction.kvcmas_plus import KVCMASPlusConfig, KVCMASPlusCorrector
from sglang_kvshare.correction.kvcomm import KVCommCorrector
from sglang_kvshare.correction.online import AnchorPoolConfig, AnchorPoolCorrector
from sglang_kvshare.correction.pool import Anchor, AnchorPool

CORRECTORS: Dict[str, Type[Corrector]] = {
    cls.name: cls
    for cls in (KVCMASCorrector, KVCMASNonChainedCorrector, KVCMASPlusCorrector, KVCommCorrector, GraphFlowCorrector)
}


def available_correctors() -> List[str]:
    return sorted(CORRECTORS)


def create_corrector(name: str, **overrides) -> Corrector:
    """A fresh corrector of method ``name``; ``overrides`` replace fields of its default config."""
    try:
        cls = CORRECTORS[name]
    except KeyError:
        raise ValueError(f"unknown correction method {name!r}; choose from {available_correctors()}") from None
    return cls(**overrides)


__all__ = [
    "Anchor",
    "AnchorPool",
    "AnchorPoolConfig",
    "AnchorPoolCorrector",
    "CORRECTORS",
    "CorrectionResult",
    "Corrector",
    "GraphFlowConfig",
    "GraphFlowCorrector",
    "KVCMASCorrector",
    "KVCMASNonChainedCorrector",
    "KVCMASPlusConfig",
    "KVCMASPlusCorrector",
    "KVCommCorrector",
    "SegmentKV",
    "available_correctors",
    "create_corrector",
]
