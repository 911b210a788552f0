"""KVCMAS (the paper): low-rank anchor pools with chained correction, and its non-chained
ablation (appendix B.5), which keeps everything but takes a context-free reference as base.

One deviation from eq. 9-10, measured: the gate softmax runs over distances relative to the
nearest anchor (``gate_scale="relative"``) at T = 0.02. Eq. 9's raw distances grow with the
segment's size, so on SmolLM2 the entropy was 0.0 on every output slot and below 0.01 on
2K-token slots: the gate accepted whatever two anchors existed. Relative distances make the
entropy say how distinct the nearest anchor is (an anchor 2 % farther weighs e^-1 of it) on
every slot length; the threshold that reaches a reuse target is set online
(``correction.tuning.TauController``), as the paper sets it by hand per workload.
"""

from __future__ import annotations

from typing import ClassVar

from sglang_kvshare.correction.online import AnchorPoolConfig, AnchorPoolCorrector


KVCMAS_CONFIG = AnchorPoolConfig(gate_scale="relative", gate_temperature=0.02)


class KVCMASCorrector(AnchorPoolCorrector):
    """Chained: anchors store factors of the source agent cache C_i (r_C = 32) and of
    Delta_{j<-i} = C_j - C_i (r_Delta = 32) per consuming agent j; V = 10 per slot."""

    name: ClassVar[str] = "kvcmas"
    chained: ClassVar[bool] = True
    needs_reference: ClassVar[bool] = False
    default_config: ClassVar[AnchorPoolConfig] = KVCMAS_CONFIG


class KVCMASNonChainedCorrector(AnchorPoolCorrector):
    """Non-chained KVCMAS: base = context-free reference, Delta_{j<-ref}; result = ref + Delta^."""

    name: ClassVar[str] = "kvcmas_nonchained"
    chained: ClassVar[bool] = False
    needs_reference: ClassVar[bool] = True
    default_config: ClassVar[AnchorPoolConfig] = KVCMAS_CONFIG
