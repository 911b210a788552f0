"""Plain-torch simulator of PReCache's LR pool and cache schedules, used by the unit tests
(``tests/unit/test_lora_cache.py``) to check the schedules against ordinary LoRA attention.

The engine's LR pool is ``sglang_kvshare/integration/model/lr_pool.py`` (SGLang's KV slots, value LR
only); this simulator keeps the paper's general form (value and key LR pools, named agents).

Schedules (``prelr_shared``, ``rebase_shared``):
what PReCache writes into the caches per forward, as pure functions.

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
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from sglang_kvshare.lora_cache.lr import Scaling, lr_values

LR_KINDS = ("value", "key")


@dataclass(frozen=True)
class LRCacheConfig:
    """Sizes of an ``LRCachePool``.

    num_slots: token slots of the KV pool the LR cache shadows (same indices).
    max_agents: LR columns per slot (agents registered with stable column indices).
    max_rank: r_max; an agent of rank r < r_max uses columns ``[:r]`` of its row.
    num_kv_heads, head_dim: of the KV cache, for byte accounting against a full KV cache.
    key_lr: also keep a key LR pool (QKVO adapters).
    """

    num_layers: int
    num_slots: int
    max_agents: int
    max_rank: int
    num_kv_heads: int
    head_dim: int
    key_lr: bool = False
    dtype: torch.dtype = torch.float32
    device: str = "cpu"

    def __post_init__(self):
        for name in ("num_layers", "num_slots", "max_agents", "max_rank", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim


class LRCachePool:
    """Value LR cache (and, for QKVO adapters, key LR cache) of every registered agent.

    Per layer and kind: a tensor ``[num_slots, max_agents, max_rank]`` of ``config.dtype``. Row
    ``slot`` holds the LR values of the token that owns KV slot ``slot``; column ``agent`` is the
    agent's stable index from ``register_agent``. Slots are owned (allocated and freed) by the KV
    pool: freeing is implicit, a reused slot is simply overwritten by the next ``write``.
    Not thread safe; the caller (the attention backend) is the only writer.
    """

    def __init__(self, config: LRCacheConfig):
        self.config = config
        shape = (config.num_slots, config.max_agents, config.max_rank)
        kinds = LR_KINDS if config.key_lr else LR_KINDS[:1]
        self._buffers: Dict[str, List[torch.Tensor]] = {
            kind: [torch.zeros(shape, dtype=config.dtype, device=config.device) for _ in range(config.num_layers)]
            for kind in kinds
        }
        self._agents: Dict[str, Tuple[int, int]] = {}  # name -> (column, rank)

    # -- agents ------------------------------------------------------------------------------
    def register_agent(self, name: str, rank: int) -> int:
        """Column index of agent ``name`` (stable for the pool's life; re-registering returns the
        same index and must give the same rank)."""
        if name in self._agents:
            col, old_rank = self._agents[name]
            if rank != old_rank:
                raise ValueError(f"agent {name!r} registered with rank {old_rank}, got {rank}")
            return col
        if not 0 < rank <= self.config.max_rank:
            raise ValueError(f"rank {rank} outside 1..{self.config.max_rank}")
        if len(self._agents) >= self.config.max_agents:
            raise ValueError(f"pool holds at most {self.config.max_agents} agents")
        col = len(self._agents)
        self._agents[name] = (col, rank)
        return col

    def agent_index(self, name: str) -> int:
        return self._agents[name][0]

    def agent_rank(self, name: str) -> int:
        return self._agents[name][1]

    @property
    def agents(self) -> Dict[str, int]:
        """name -> column index, in registration order."""
        return {name: col for name, (col, _) in self._agents.items()}

    @property
    def num_agents(self) -> int:
        return len(self._agents)

    # -- data --------------------------------------------------------------------------------
    def buffer(self, layer: int, kind: str = "value") -> torch.Tensor:
        """The layer's whole buffer ``[num_slots, max_agents, max_rank]`` (a view, for kernels)."""
        if kind not in self._buffers:
            raise KeyError(f"no {kind!r} LR cache (key_lr={self.config.key_lr})")
        return self._buffers[kind][layer]

    def write(
        self,
        layer: int,
        slots: torch.Tensor,
        values: torch.Tensor,
        agent: Optional[str] = None,
        kind: str = "value",
        columns: Optional[Sequence[int]] = None,
    ) -> None:
        """Store LR values of the tokens at KV slots ``slots`` [T] (int64).

        agent None: ``values`` [T, n, r] with n <= max_agents, r <= max_rank, written to columns
            ``0..n-1`` (all registered agents at once, as ``prelr_shared`` produces them), or only
            to ``columns`` when given (``LRWrite.columns``).
        agent name: ``values`` [T, r_agent], written to that agent's column only.
        """
        buf = self.buffer(layer, kind)
        values = values.to(buf.dtype)
        if agent is None:
            n_max, r_max = buf.shape[1:]
            if values.dim() != 3 or values.shape[1] > n_max or values.shape[2] > r_max:
                raise ValueError(f"values must be [T, <= {buf.shape[1]}, <= {buf.shape[2]}], got {tuple(values.shape)}")
            n, r = values.shape[1:]
            if columns is None:
                buf[slots, :n, :r] = values
            else:
                cols = torch.as_tensor(list(columns), dtype=torch.long, device=buf.device)
                buf[slots[:, None], cols[None, :], :r] = values[:, cols]
        else:
            col, rank = self._agents[agent]
            if values.dim() != 2 or values.shape[1] != rank:
                raise ValueError(f"values must be [T, {rank}], got {tuple(values.shape)}")
            buf[slots, col, :rank] = values

    def read(self, layer: int, slots: torch.Tensor, agent: str, kind: str = "value") -> torch.Tensor:
        """LR values ``[T, r_agent]`` of agent ``agent`` at KV slots ``slots`` [T] (a copy)."""
        col, rank = self._agents[agent]
        return self.buffer(layer, kind)[slots, col, :rank]

    # -- accounting --------------------------------------------------------------------------
    def nbytes(self) -> int:
        """Bytes held by all LR buffers (all layers, kinds, slots and agent columns)."""
        return sum(t.numel() * t.element_size() for bufs in self._buffers.values() for t in bufs)

    def nbytes_per_token(self, num_agents: Optional[int] = None) -> int:
        """LR bytes per token over all layers for ``num_agents`` agents (default: registered)
        at their padded rank ``max_rank``. A full KV cache costs ``num_layers * 2 * kv_dim *
        itemsize`` per token and agent, so the ratio per agent is ``max_rank / (2 * kv_dim)``
        for QV adapters and ``max_rank / kv_dim`` for QKVO (value + key LR)."""
        n = self.num_agents if num_agents is None else num_agents
        itemsize = torch.empty((), dtype=self.config.dtype).element_size()
        return self.config.num_layers * len(self._buffers) * n * self.config.max_rank * itemsize


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
    x_adpt: Optional[torch.Tensor], x_neut: torch.Tensor, A_all: torch.Tensor, scaling: Scaling, current_agent: int
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
