"""Moving already-rotated keys from position p to p + delta.

RoPE rotates each channel pair by an angle ``pos * inv_freq[i]``; rotations compose, so
``R(p + d) = R(d) R(p)`` and a cached key is moved by rotating it by ``d`` alone. Only the first
``rotary_dim`` channels rotate. All trigonometry runs in float32 whatever the cache dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Optional, Union

import torch


@dataclass(frozen=True)
class RopeSpec:
    """What the model's rotary embedding did to the cached keys.

    inv_freq: [rotary_dim // 2] float32, already including any llama3 frequency scaling.
    is_neox: True when pairs are (i, i + rotary_dim/2) ("rotate_half"), False for GPT-J
    interleaved pairs (2i, 2i+1).
    """

    inv_freq: torch.Tensor
    rotary_dim: int
    is_neox: bool = True


def inv_freq_for(rotary_dim: int, base: float, rope_scaling: Optional[Mapping] = None) -> torch.Tensor:
    """Inverse frequencies [rotary_dim // 2] (float32) for default or llama3 RoPE.

    Any other scaling type raises: YaRN-style scalings also rescale magnitudes, which a pure
    rotation cannot re-align.
    """
    # NOTE: float32, as the models compute it: a one-ulp difference times a position of
    # thousands is a visible angle error.
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    kind = None
    if rope_scaling:
        kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
    if kind in (None, "default"):
        return inv_freq.float()
    if kind != "llama3":
        raise ValueError(f"RoPE scaling {kind!r} cannot be re-aligned exactly")
    factor = float(rope_scaling["factor"])
    low = float(rope_scaling.get("low_freq_factor", 1.0))
    high = float(rope_scaling.get("high_freq_factor", 4.0))
    old_len = float(rope_scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    out = torch.where(mid, smoothed, out)
    return out.float()


def shift_keys(k: torch.Tensor, delta: Union[int, torch.Tensor], spec: RopeSpec) -> torch.Tensor:
    """Return keys re-rotated by ``delta`` positions (a new tensor, same dtype as ``k``).

    k: [T, H, D] keys that already carry RoPE at their old positions.
    delta: an int, or [T] int tensor (per token); negative moves keys backwards.
    """
    if k.dim() != 3:
        raise ValueError(f"keys must be [T, H, D], got {tuple(k.shape)}")
    rd = spec.rotary_dim
    if isinstance(delta, int):
        if k.dtype == torch.float32:
            return rotate_keys_(k.clone(), delta, spec)
        if delta == 0:
            return k.clone()
        d = torch.full((k.shape[0],), float(delta), dtype=torch.float64)
    else:
        d = delta.to(torch.float64).reshape(-1)
    # float64 angles: positions up to 1e5+ times inv_freq lose precision in float32
    ang = (d[:, None] * spec.inv_freq.to(torch.float64)[None, :]).to(k.device)  # [T, rd/2]
    out = k.clone()
    out[..., :rd] = rotate(k, ang.cos().float(), ang.sin().float(), spec).to(k.dtype)
    return out


@torch.no_grad()
def rotate_keys_(k: torch.Tensor, delta: int, spec: RopeSpec) -> torch.Tensor:
    """Move float32 keys ``k`` [..., head_dim] (any leading layout: tokens, layers, heads) by
    the same ``delta`` positions, in place; returns ``k``.

    One angle for every token, so the rotation is five passes over half the channels with no
    copy of the tensor (``shift_keys`` builds per-token tables and new tensors: 2-3x slower on a
    2K-token segment of every layer).
    """
    if k.dtype != torch.float32:
        raise TypeError(f"in-place rotation needs float32 keys, got {k.dtype}")
    if delta == 0:
        return k
    rd = spec.rotary_dim
    ang = float(delta) * spec.inv_freq.to(torch.float64)
    cos, sin = ang.cos().float().to(k.device), ang.sin().float().to(k.device)
    if spec.is_neox:
        x1, x2 = k[..., : rd // 2], k[..., rd // 2 : rd]
    else:
        x1, x2 = k[..., 0:rd:2], k[..., 1:rd:2]
    x1_sin = x1 * sin
    x1.mul_(cos).addcmul_(x2, sin, value=-1.0)  # x1 cos - x2 sin
    x2.mul_(cos).add_(x1_sin)  # x2 cos + x1 sin
    return k


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    """The rotary part of ``x`` [T, H, D] turned by per-token angles given as ``cos``/``sin``
    [T, rotary_dim // 2]: [T, H, rotary_dim] float32 (the caller keeps dims past rotary_dim)."""
    rd = spec.rotary_dim
    cos, sin = cos[:, None, :], sin[:, None, :]
    x = x[..., :rd].float()
    if spec.is_neox:
        x1, x2 = x[..., : rd // 2], x[..., rd // 2 :]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
