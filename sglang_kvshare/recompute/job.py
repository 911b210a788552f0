"""One shared segment of a request whose reused KV is partly recomputed in the engine: what the
scheduler side hands the model side (plain torch)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from sglang_kvshare.recompute.base import RecomputePlan
from sglang_kvshare.recompute.hidden_store import StoredHidden


@dataclass
class RecomputeJob:
    """One shared segment of a request whose KV is reused and partly recomputed."""

    start: int  # position of the segment's first token
    # [num_layers, n, kv_heads, head_dim] reused K/V at the request's positions; None once the
    # forward that reached the segment's last token has used them
    k: Optional[torch.Tensor]
    v: Optional[torch.Tensor]
    selector: str
    ratio: float
    plan: Optional[RecomputePlan] = None  # DroidSpeak: fixed before the forward
    hidden: Optional[StoredHidden] = None
    token_layers: int = 0  # token-layers executed so far (check pass included)
    layer_groups: tuple = ()
    n: int = 0
    num_layers: int = 0

    def __post_init__(self) -> None:
        self.num_layers, self.n = int(self.k.shape[0]), int(self.k.shape[1])

    def release(self) -> None:
        self.k = self.v = self.hidden = None
