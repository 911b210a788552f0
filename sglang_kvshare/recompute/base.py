"""Contract of the selective recomputation baselines (KVCMAS Sec. 2.2, Eq. 3).

Conventions shared by every module of this package:

- A per-layer cache of one shared (PH) segment is a tensor ``[num_layers, seg_len, D]`` with
  ``D = num_kv_heads * head_dim``, in canonical coordinates (keys already re-aligned to the target
  positions). Wherever a cache is accepted, a ``(k, v)`` pair of such tensors is accepted too and
  treated as their concatenation along the last dim (``[num_layers, seg_len, 2 * D]``), so every
  deviation below is K and V deviation summed.
- "reused" is the aligned source cache ``C_i``; "recomputed" is what the engine obtains by running
  the model under the target agent's context; "exact" is the dense target cache ``C_j``, which only
  exists in profiling and evaluation.
- The budget knob is ``ratio`` in [0, 1], the recompute fraction; the reuse ratio is
  ``rho = 1 - ratio``. ``ratio * n`` is rounded half up (``num_selected``).
- A ``RecomputePlan.mask[l, t]`` is True when token ``t`` of the segment gets its KV at layer ``l``
  recomputed; the resulting cache is ``compose(reused, recomputed, mask)`` (Eq. 3).
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass
from typing import ClassVar, Dict, Optional, Tuple, Union

import torch

KV = Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]


def stack_kv(kv: KV) -> torch.Tensor:
    """A cache as one tensor: a ``(k, v)`` pair becomes ``torch.cat([k, v], -1)``; a tensor is
    returned as is. Shapes ``[..., D]`` -> ``[..., 2D]``; k and v must have equal shapes."""
    if isinstance(kv, torch.Tensor):
        return kv
    k, v = kv
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} differ in shape")
    return torch.cat([k, v], dim=-1)


def check_ratio(ratio: float) -> float:
    """Return ``ratio`` as float; raise ValueError unless 0 <= ratio <= 1."""
    ratio = float(ratio)
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"recompute ratio must be in [0, 1], got {ratio}")
    return ratio


def num_selected(ratio: float, total: int) -> int:
    """``ratio * total`` rounded half up, in [0, total]. 0 -> 0 and 1 -> total exactly."""
    ratio = check_ratio(ratio)
    return min(int(total), int(math.floor(ratio * total + 0.5)))


def token_deviation(reused_layer: KV, recomputed_layer: KV) -> torch.Tensor:
    """Per-token KV deviation of one layer: ``||reused[t] - recomputed[t]||_2^2`` over features.

    reused_layer, recomputed_layer: ``[seg_len, D]`` (or ``(k, v)`` pairs). Returns float32
    ``[seg_len]``. Computed in float32 whatever the cache dtype.
    """
    a, b = stack_kv(reused_layer), stack_kv(recomputed_layer)
    if a.shape != b.shape or a.dim() != 2:
        raise ValueError(f"expected two [seg_len, D] tensors, got {tuple(a.shape)}, {tuple(b.shape)}")
    return (a.float() - b.float()).pow(2).sum(dim=-1)


def entry_deviation(reused: KV, exact: KV) -> torch.Tensor:
    """Squared error of every token-layer: ``||reused[l, t] - exact[l, t]||_2^2``.

    reused, exact: ``[num_layers, seg_len, D]``. Returns float32 ``[num_layers, seg_len]``; its sum
    is the squared Frobenius norm of the whole reuse error.
    """
    a, b = stack_kv(reused), stack_kv(exact)
    if a.shape != b.shape or a.dim() != 3:
        raise ValueError(f"expected two [num_layers, seg_len, D] tensors, got {tuple(a.shape)}, {tuple(b.shape)}")
    return (a.float() - b.float()).pow(2).sum(dim=-1)


def rank_desc(scores: torch.Tensor) -> torch.Tensor:
    """Indices sorting ``scores`` (1-D) from highest to lowest; ties keep the lower index first."""
    return torch.argsort(scores, descending=True, stable=True)


def compose(reused: KV, recomputed: KV, mask: torch.Tensor) -> torch.Tensor:
    """Eq. 3: take ``recomputed[l, t]`` where ``mask[l, t]`` else ``reused[l, t]``.

    reused, recomputed: ``[num_layers, seg_len, D]`` (pairs are concatenated, see ``stack_kv``);
    mask: bool ``[num_layers, seg_len]``. Returns a new tensor in ``reused``'s dtype; neither input
    is modified.
    """
    a, b = stack_kv(reused), stack_kv(recomputed)
    if a.shape != b.shape or tuple(mask.shape) != tuple(a.shape[:2]):
        raise ValueError(
            f"shapes disagree: reused {tuple(a.shape)}, recomputed {tuple(b.shape)}, mask {tuple(mask.shape)}"
        )
    return torch.where(mask.to(a.device).unsqueeze(-1), b.to(a.dtype), a)


@dataclass(frozen=True)
class RecomputePlan:
    """Which token-layers of one shared segment the engine recomputes.

    mask: bool ``[num_layers, seg_len]``; True = recompute the KV of token ``t`` at layer ``l``
    (under the target agent's context), False = keep the reused KV. The plan never holds caches.
    ratio: the requested recompute ratio (the knob); the realised token-layer fraction is
    ``recompute_ratio`` and may exceed it (CacheBlend's check layers) or differ by rounding.
    layer_groups: contiguous ``[start, end)`` layer ranges the method recomputes (DroidSpeak groups,
    the RelayCaching range, CacheBlend's ``[0, num_layers)``), empty for an empty plan.
    """

    method: str
    ratio: float
    mask: torch.Tensor
    layer_groups: Tuple[Tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        if self.mask.dtype != torch.bool or self.mask.dim() != 2:
            raise ValueError(f"mask must be bool [num_layers, seg_len], got {self.mask.dtype} {tuple(self.mask.shape)}")

    @property
    def num_layers(self) -> int:
        return int(self.mask.shape[0])

    @property
    def seg_len(self) -> int:
        return int(self.mask.shape[1])

    @property
    def recomputed_token_layers(self) -> int:
        """Number of (layer, token) entries recomputed: ``mask.sum()``."""
        return int(self.mask.sum().item())

    @property
    def num_reused_token_layers(self) -> int:
        return self.num_layers * self.seg_len - self.recomputed_token_layers

    @property
    def num_reused_tokens(self) -> int:
        """Tokens whose KV is reused in every layer (recomputed in none)."""
        return int((~self.mask.any(dim=0)).sum().item())

    @property
    def num_recomputed_tokens(self) -> int:
        """Tokens recomputed in at least one layer (each is a query row in some forward pass)."""
        return self.seg_len - self.num_reused_tokens

    @property
    def recompute_ratio(self) -> float:
        """Realised fraction of recomputed token-layers; 0.0 for an empty segment."""
        total = self.num_layers * self.seg_len
        return self.recomputed_token_layers / total if total else 0.0

    @property
    def rho(self) -> float:
        """Realised reuse ratio ``1 - recompute_ratio`` (token-layer count)."""
        return 1.0 - self.recompute_ratio

    @property
    def is_empty(self) -> bool:
        return not bool(self.mask.any())

    @property
    def is_dense(self) -> bool:
        return bool(self.mask.all())

    def token_indices(self, layer: int) -> torch.Tensor:
        """int64 ``[n]``: ascending indices of the tokens recomputed at ``layer``."""
        return torch.nonzero(self.mask[layer], as_tuple=False).flatten()

    def hidden_state_entries(self) -> Dict[int, torch.Tensor]:
        """Where recomputation starts: ``{layer: token indices}`` for every token-layer recomputed at
        ``layer`` but not at ``layer - 1``. The engine must supply those tokens' hidden states
        entering ``layer`` from outside the recomputation (the embedding lookup at layer 0, else a
        stored or separately computed residual stream). Within a run of consecutive recomputed
        layers the previous layer's output is the next input. Ascending layers, int64 indices.
        """
        prev = torch.zeros_like(self.mask[:1])
        starts = self.mask & ~torch.cat([prev, self.mask[:-1]], dim=0)
        out: Dict[int, torch.Tensor] = {}
        for layer in torch.nonzero(starts.any(dim=1), as_tuple=False).flatten().tolist():
            out[layer] = torch.nonzero(starts[layer], as_tuple=False).flatten()
        return out

    @classmethod
    def empty(cls, method: str, num_layers: int, seg_len: int, device=None) -> "RecomputePlan":
        mask = torch.zeros(num_layers, seg_len, dtype=torch.bool, device=device)
        return cls(method=method, ratio=0.0, mask=mask)

    @classmethod
    def dense(cls, method: str, num_layers: int, seg_len: int, device=None) -> "RecomputePlan":
        mask = torch.ones(num_layers, seg_len, dtype=torch.bool, device=device)
        groups = ((0, num_layers),) if num_layers and seg_len else ()
        return cls(method=method, ratio=1.0, mask=mask, layer_groups=groups)


@dataclass(frozen=True)
class SelectionInputs:
    """Run-time inputs a selector may need for one segment; a selector lists the ones it reads in
    ``BaseSelector.requires`` (they may stay None at ratio 0 and 1).

    reused_kv: ``[>= check_layers, seg_len, D]`` reused cache (at least the check layers).
    recomputed_kv: ``[>= check_layers, seg_len, D]`` KV of the check layers recomputed for ALL
    segment tokens (CacheBlend).
    token_deviation: float ``[seg_len]`` per-token deviation (RelayCaching), e.g. from
    ``token_deviation`` on a check layer.
    attention_mass: float ``[seg_len]`` attention received by each segment token from the target's
    last query tokens (RelayCaching, see ``relaycaching.attention_mass``).
    """

    num_layers: int
    seg_len: int
    reused_kv: Optional[KV] = None
    recomputed_kv: Optional[KV] = None
    token_deviation: Optional[torch.Tensor] = None
    attention_mass: Optional[torch.Tensor] = None

    def need(self, *names: str) -> None:
        missing = [n for n in names if getattr(self, n) is None]
        if missing:
            raise ValueError(f"selection needs {', '.join(missing)}")


class BaseSelector(abc.ABC):
    """A selective recomputation rule: ratio + run-time inputs -> RecomputePlan.

    ``plan`` does not modify its inputs and never runs the model; the engine executes the plan.
    At ratio 0 every selector returns an empty plan (no recomputation, no check pass) and at ratio 1
    a dense one (every token-layer), without reading ``requires``.
    """

    name: ClassVar[str]
    requires: ClassVar[Tuple[str, ...]] = ()

    @abc.abstractmethod
    def plan(self, ratio: float, inputs: SelectionInputs) -> RecomputePlan:
        """Recompute plan ``[inputs.num_layers, inputs.seg_len]`` for budget ``ratio``."""
