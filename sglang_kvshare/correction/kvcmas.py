"""KVCMAS (the paper): low-rank anchor pools with chained correction, and its non-chained
ablation (appendix B.5), which keeps everything but takes a context-free reference as base."""

from __future__ import annotations

from typing import ClassVar

from sglang_kvshare.correction.online import AnchorPoolConfig, AnchorPoolCorrector


class KVCMASCorrector(AnchorPoolCorrector):
    """Chained: anchors store factors of the source agent cache C_i (r_C = 32) and of
    Delta_{j<-i} = C_j - C_i (r_Delta = 32) per consuming agent j; V = 10 per slot."""

    name: ClassVar[str] = "kvcmas"
    chained: ClassVar[bool] = True
    needs_reference: ClassVar[bool] = False
    default_config: ClassVar[AnchorPoolConfig] = AnchorPoolConfig()


class KVCMASNonChainedCorrector(AnchorPoolCorrector):
    """Non-chained KVCMAS: base = context-free reference, Delta_{j<-ref}; result = ref + Delta^."""

    name: ClassVar[str] = "kvcmas_nonchained"
    chained: ClassVar[bool] = False
    needs_reference: ClassVar[bool] = True
    default_config: ClassVar[AnchorPoolConfig] = AnchorPoolConfig()
