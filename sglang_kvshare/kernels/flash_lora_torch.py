"""Flash-LoRA-Attention over a paged KV pool in torch: the reference of the Triton kernel
(``flash_lora_attention``) and the torch serving path (CPU). Same contract and layouts as the
kernel (see ``flash_lora_attention``'s module docstring)."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from sglang_kvshare.lora_cache.attention import expand_key_lr, flash_lora_attention
from sglang_kvshare.rope.align import RopeSpec, rotate, shift_keys


class KeyLR(NamedTuple):
    """Key LR inputs (QKVO adapters): lr_k_buf [S, n_agents, r_max], B_k [n_agents, r_max,
    Hkv*D], rope (neox, rotary_dim == head_dim for the kernel)."""

    lr_k_buf: torch.Tensor
    B_k: torch.Tensor
    rope: RopeSpec


class KeyShift(NamedTuple):
    """KV views: ``shift`` [sum kv_len] int, aligned with kv_indices: the key in that slot carries
    RoPE ``shift`` positions earlier than the request reads it (0: at its own position); rope
    (neox, rotary_dim == head_dim for the kernel). Each key is turned by +shift before scoring."""

    shift: torch.Tensor
    rope: RopeSpec


class KVLeafRows(NamedTuple):
    """KV leaves of one layer (``cache/leaves.py``: an accepted correction kept as ``A @ B``
    beside the cached K/V): key i of kv_indices is read as ``k + A_k[row[i]] B_k[leaf[i]]`` and
    ``v + A_v[row[i]] B_v[leaf[i]]`` (``leaf[i]`` -1: as cached). ``leaf``, ``row`` [sum kv_len]
    int aligned with kv_indices; A_k, A_v [rows, r]; B_k, B_v [n_leaves, r, Hkv*D] (zero rows
    beyond a leaf's rank). The key term is in the RoPE frame of the cached key, so it is added
    before a key shift turns the key."""

    leaf: torch.Tensor
    row: torch.Tensor
    A_k: torch.Tensor
    B_k: torch.Tensor
    A_v: torch.Tensor
    B_v: torch.Tensor


def _leaf_delta(leaves: KVLeafRows, k0: int, k1: int, A: torch.Tensor, B: torch.Tensor, shape) -> torch.Tensor:
    """[k1 - k0, H, D] float32: the dense leaf term of keys k0:k1 (zero where none)."""
    leaf, row = leaves.leaf[k0:k1].long(), leaves.row[k0:k1].long()
    out = torch.zeros(k1 - k0, shape[0] * shape[1], dtype=torch.float32, device=A.device)
    has = leaf >= 0
    out[has] = torch.bmm(A[row[has]].float().unsqueeze(1), B[leaf[has]].float()).squeeze(1)
    return out.view(k1 - k0, *shape)


def _keys(
    k_buf: torch.Tensor,
    slots: torch.Tensor,
    k0: int,
    k1: int,
    key_shift: Optional[KeyShift],
    key_leaf: Optional[KVLeafRows] = None,
):
    k = k_buf[slots]
    if key_leaf is not None:
        k = k.float() + _leaf_delta(key_leaf, k0, k1, key_leaf.A_k, key_leaf.B_k, k.shape[1:])
    return k if key_shift is None else shift_keys(k, key_shift.shift[k0:k1], key_shift.rope)


def _values(v_buf: torch.Tensor, slots: torch.Tensor, k0: int, k1: int, key_leaf: Optional[KVLeafRows]):
    v = v_buf[slots]
    if key_leaf is None:
        return v
    return v.float() + _leaf_delta(key_leaf, k0, k1, key_leaf.A_v, key_leaf.B_v, v.shape[1:])


def flash_lora_attention_reference(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    kv_indices: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    lr_buf: Optional[torch.Tensor] = None,
    B_v: Optional[torch.Tensor] = None,
    agent: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    causal: bool = True,
    key_lr: Optional[KeyLR] = None,
    key_shift: Optional[KeyShift] = None,
    key_leaf: Optional[KVLeafRows] = None,
    **_unused,
) -> torch.Tensor:
    """Torch reference of ``flash_lora_attention_triton`` (same contract): gathers each request's
    slots (with their leaf rows added) and calls ``sglang_kvshare.lora_cache.flash_lora_attention(_qkvo)``."""
    out = torch.empty_like(q)
    num_req = qo_indptr.numel() - 1
    for b in range(num_req):
        q0, q1 = int(qo_indptr[b]), int(qo_indptr[b + 1])
        k0, k1 = int(kv_indptr[b]), int(kv_indptr[b + 1])
        if q1 == q0:
            continue
        slots = kv_indices[k0:k1].long()
        j = -1 if agent is None else int(agent[b])
        if lr_buf is not None and agent is None:
            j = 0
        lr = lr_buf[slots, j] if (lr_buf is not None and j >= 0) else None
        bv = B_v[j] if lr is not None else None
        k = _keys(k_buf, slots, k0, k1, key_shift, key_leaf)
        if key_lr is not None and j >= 0:
            pos = torch.arange(k.shape[0], device=k.device)
            k = (
                k.float()
                + expand_key_lr(key_lr.lr_k_buf[slots, j], key_lr.B_k[j], k.shape[1], pos, key_lr.rope).float()
            )
        out[q0:q1] = flash_lora_attention(q[q0:q1], k, _values(v_buf, slots, k0, k1, key_leaf), lr, bv, scale, causal)
    return out


def flash_lora_attention_sdpa(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    kv_indices: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    lr_buf: Optional[torch.Tensor] = None,
    B_v: Optional[torch.Tensor] = None,
    agent: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    causal: bool = True,
    key_lr: Optional[KeyLR] = None,
    key_shift: Optional[KeyShift] = None,
    key_leaf: Optional[KVLeafRows] = None,
    **_unused,
) -> torch.Tensor:
    """Torch serving path (same contract as the kernel): per request one
    ``scaled_dot_product_attention`` call whose values carry the agent's LR column as r extra
    channels, so it yields ``P V_base`` and ``P LR_j`` together; ``(P LR_j) B_j`` is then added per
    query head (GQA: KV head g's columns of B). With ``key_lr`` an adapted request's keys are
    ``K_base + RoPE(LR_k B_k)``, the delta rotated at each key's index in its request
    (``rotate_key_delta``); with ``key_shift`` the base keys are turned first, after their leaf
    rows (``key_leaf``) are added. Runs in q.dtype."""
    import torch.nn.functional as F

    out = torch.empty_like(q)
    Hq, D = q.shape[1], q.shape[2]
    Hkv = k_buf.shape[1]
    G = Hq // Hkv
    scale = D**-0.5 if scale is None else scale
    for b in range(qo_indptr.numel() - 1):
        q0, q1 = int(qo_indptr[b]), int(qo_indptr[b + 1])
        k0, k1 = int(kv_indptr[b]), int(kv_indptr[b + 1])
        q_len, kv_len = q1 - q0, k1 - k0
        if q_len == 0:
            continue
        slots = kv_indices[k0:k1].long()
        qi = q[q0:q1].transpose(0, 1)  # [Hq, q, D]
        k = _keys(k_buf, slots, k0, k1, key_shift, key_leaf).transpose(0, 1).to(q.dtype)  # [Hkv, kv, D]
        v = _values(v_buf, slots, k0, k1, key_leaf).transpose(0, 1).to(q.dtype)
        j = -1 if lr_buf is None else (0 if agent is None else int(agent[b]))
        if key_lr is not None and j >= 0:
            delta = rotate_key_delta(key_lr.lr_k_buf[slots, j], key_lr.B_k[j], Hkv, key_lr.rope)
            k = k + delta.transpose(0, 1).to(q.dtype)
        if j >= 0:
            lr = lr_buf[slots, j].to(q.dtype)  # [kv, r]
            v = torch.cat([v, lr.unsqueeze(0).expand(Hkv, -1, -1)], dim=-1)
            # NOTE: SDPA's fused (flash) CPU/CUDA kernels need one head size for q, k and v; with
            # D + r value channels alone it falls back to the math path, which materialises the
            # [Hq, q, kv] scores (~360 MB transient and 3-4x the time for a 2K prefill on SmolLM2).
            # Zero channels on q and k leave the scores unchanged (the scale stays 1/sqrt(D)).
            pad = (0, v.shape[-1] - D)
            qi, k = F.pad(qi, pad), F.pad(k, pad)
        mask = None
        if causal and q_len > 1:  # a single query is the last position: it sees every key
            q_pos = torch.arange(kv_len - q_len, kv_len, device=q.device)[:, None]
            mask = torch.arange(kv_len, device=q.device)[None, :] <= q_pos
        o = F.scaled_dot_product_attention(
            qi.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask, scale=scale, enable_gqa=G > 1
        ).squeeze(0)  # [Hq, q, D (+ r)]
        res = o[..., :D]
        if j >= 0:
            r = lr_buf.shape[2]
            Bh = B_v[j].to(q.dtype).view(r, Hkv, D).permute(1, 0, 2).repeat_interleave(G, 0)
            res = res + torch.bmm(o[..., D:], Bh)  # [Hq, q, r] @ [Hq, r, D]
        out[q0:q1] = res.transpose(0, 1)
    return out


_ROPE_TABLES: dict = {}


def _rope_table(rope: RopeSpec, n: int, device) -> tuple:
    """(cos, sin) [>= n, rotary_dim // 2] float32 for positions 0.., cached per RopeSpec and
    device (float64 angles, as ``shift_keys``), grown by doubling."""
    key = (id(rope), str(device))
    hit = _ROPE_TABLES.get(key)
    if hit is None or hit[2] is not rope or hit[0].shape[0] < n:
        m = max(n, 256, 2 * (0 if hit is None else hit[0].shape[0]))
        ang = torch.arange(m, dtype=torch.float64)[:, None] * rope.inv_freq.double()[None, :]
        hit = (ang.cos().float().to(device), ang.sin().float().to(device), rope)
        _ROPE_TABLES[key] = hit
    return hit[0][:n], hit[1][:n]


def rotate_key_delta(lr_k: torch.Tensor, B_k: torch.Tensor, num_kv_heads: int, rope: RopeSpec) -> torch.Tensor:
    """``RoPE(LR_k B_k)`` [T, Hkv, D] float32 for T keys at positions 0 .. T-1 (their indices in
    the request): lr_k [T, r] (scaling folded in), B_k [r, Hkv * D]. Same math as
    ``lora_cache.expand_key_lr``, with cached trigonometry (``rope.align.rotate``)."""
    T = lr_k.shape[0]
    x = (lr_k.float() @ B_k.float()).view(T, num_kv_heads, -1)
    rot = rotate(x, *_rope_table(rope, T, x.device), rope)
    return rot if rope.rotary_dim == x.shape[-1] else torch.cat((rot, x[..., rope.rotary_dim :]), dim=-1)
