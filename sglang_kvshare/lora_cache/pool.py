"""LRCachePool: per-layer LR caches of all agents, indexed by the KV pool's token slots."""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from sglang_kvshare.lora_cache.base import LR_KINDS, LRCacheConfig


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
            kind: [
                torch.zeros(shape, dtype=config.dtype, device=config.device)
                for _ in range(config.num_layers)
            ]
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
                raise ValueError(f"values must be [T, <= {buf.shape[1]}, <= {buf.shape[2]}], "
                                 f"got {tuple(values.shape)}")
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

    def read(
        self, layer: int, slots: torch.Tensor, agent: str, kind: str = "value"
    ) -> torch.Tensor:
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
