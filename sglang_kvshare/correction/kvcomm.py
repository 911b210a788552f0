"""KVComm baseline (Ye et al., 2025): full-dimensional anchors relative to a context-free
reference, V = 20, entropy gate tau = 0.3 on the value cache (eq. 9-10 as its code computes it:
softmax over raw distances), layer 0 never corrected, and a segment is corrected only when two
anchors cover all of it (its ``predict_as_anchor``), else prefilled densely.

Only the placeholder (PH) correction is modelled; KVComm's per-channel prefix (PF) deltas are out
of scope of this interface (PF segments are always prefilled by the target agent).
"""

from __future__ import annotations

from typing import ClassVar

from sglang_kvshare.correction.online import AnchorPoolConfig, AnchorPoolCorrector


class KVCommCorrector(AnchorPoolCorrector):
    name: ClassVar[str] = "kvcomm"
    chained: ClassVar[bool] = False
    needs_reference: ClassVar[bool] = True
    default_config: ClassVar[AnchorPoolConfig] = AnchorPoolConfig(
        num_anchors=20, tau=0.3, rank_base=None, rank_delta=None, skip_layers=(0,), full_coverage=True
    )
