"""What PReCache writes into the caches per forward, as pure functions (engine wiring elsewhere).

``prelr_shared``: the agent processing new tokens (adapted hidden states ``X_adpt``) writes the
    shared base cache from ``X_adpt W_0`` and the LR cache of *every* agent ``k`` from
    ``s_k X_adpt A_k^T``, so later agents reuse both without re-processing the tokens.
``rebase_shared``: the shared base cache comes from the adapter-free pass (``X_neut W_0``, the
    neutral base cache); the current agent ``j``'s LR column from ``X_adpt`` (its own generation
    path), every other agent's column from ``X_neut``. DB (double batching) runs both passes in the
    same forward; LP (lazy prefill) writes column ``j`` during the turn and the other columns and
    the neutral base in a post-turn adapter-free prefill: both end in the same cache state.

Hidden states are the projection inputs of one layer (after the input RMSNorm): [T, d_in].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from sglang_kvshare.lora_cache.lr import Scaling, lr_values

CACHE_METHODS = ("prelr_shared", "rebase_shared")


@dataclass(frozen=True)
class LRWrite:
    """One layer's cache writes for T new tokens.

    base_source: which hidden states feed the shared base KV ("adapted" or "neutral").
    lr: [T, n_agents, r_max] LR values for all agent columns (scaling folded in).
    columns: the agent columns this write fills (``LRCachePool.write(layer, slots, lr,
        columns=columns)``); the others are left as they are.
    """

    base_source: str
    lr: torch.Tensor
    columns: Tuple[int, ...]


def prelr_shared(x_adpt: torch.Tensor, A_all: torch.Tensor, scaling: Scaling) -> LRWrite:
    """PreLRShared: x_adpt [T, d_in] (current agent's adapted hidden states), A_all
    [n_agents, r_max, d_in], scaling [n_agents] -> base from ``x_adpt``, LR of every agent from
    ``x_adpt`` (one matmul)."""
    lr = lr_values(x_adpt, A_all, scaling)
    return LRWrite(base_source="adapted", lr=lr, columns=tuple(range(lr.shape[1])))


def rebase_shared(
    x_adpt: Optional[torch.Tensor],
    x_neut: torch.Tensor,
    A_all: torch.Tensor,
    scaling: Scaling,
    current_agent: int,
) -> LRWrite:
    """ReBaseShared: neutral base cache from x_neut [T, d_in]; LR column ``current_agent`` from
    x_adpt [T, d_in] (the agent's own adapted states), every other column from x_neut.

    x_adpt None (LP post-turn prefill; the current agent's column was written from its adapted
    states during its turn): ``columns`` excludes ``current_agent``.
    """
    lr = lr_values(x_neut, A_all, scaling)
    columns = tuple(range(lr.shape[1]))
    if x_adpt is None:
        columns = tuple(c for c in columns if c != current_agent)
    else:
        s = torch.as_tensor(scaling, dtype=x_adpt.dtype, device=x_adpt.device).reshape(-1)
        s_j = s[current_agent] if s.numel() > 1 else s[0]
        lr[:, current_agent] = lr_values(x_adpt, A_all[current_agent], float(s_j))
    return LRWrite(base_source="neutral", lr=lr, columns=columns)
