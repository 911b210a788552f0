"""Paged attention batches for the Flash-LoRA-Attention kernel tests (the Triton interpreter on
the CPU, ``tests/unit``; compiled on CUDA, ``tests/gpu``): CPU tensors, seeded."""

import torch

from sglang_kvshare.kernels.flash_lora_torch import KeyLR, KeyShift, KVLeafRows
from sglang_kvshare.rope.align import RopeSpec, inv_freq_for, shift_keys

HQ, HKV, D, R, N_AGENTS, SLOTS = 9, 3, 64, 8, 3, 48


def paged_batch(q_lens, kv_lens, seed=0, key_lr=False):
    """A paged batch: random KV pool, LR pools, stacked B factors, scattered slots."""
    g = torch.Generator().manual_seed(seed)
    k_buf = torch.randn(SLOTS, HKV, D, generator=g)
    v_buf = torch.randn(SLOTS, HKV, D, generator=g)
    lr_buf = torch.randn(SLOTS, N_AGENTS, R, generator=g)
    B_v = torch.randn(N_AGENTS, R, HKV * D, generator=g) * 0.2
    kv_indices = torch.randperm(SLOTS, generator=g)[: sum(kv_lens)].to(torch.int32)
    qo_indptr = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    kv_indptr = torch.tensor([0] + kv_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    q = torch.randn(sum(q_lens), HQ, D, generator=g)
    kw = dict(lr_buf=lr_buf, B_v=B_v)
    if key_lr:
        rope = RopeSpec(inv_freq_for(D, 100000.0), D, is_neox=True)
        kw["key_lr"] = KeyLR(
            torch.randn(SLOTS, N_AGENTS, R, generator=g), torch.randn(N_AGENTS, R, HKV * D, generator=g) * 0.2, rope
        )
    return (q, k_buf, v_buf, kv_indices, qo_indptr, kv_indptr), kw


def views_batch(key_lr=False):
    """A batch whose requests read spans in other requests' slots (KV views): the pool holds the
    keys with RoPE ``shift`` positions earlier than the requests read them. Returns the batch
    with the keys as a copy would hold them, the pool as views hold it, and the per-key shifts."""
    args, kw = paged_batch([6, 1], [30, 17], seed=5, key_lr=key_lr)
    q, k_true, v_buf, kv_indices, qo_indptr, kv_indptr = args
    shift = torch.zeros(kv_indices.shape, dtype=torch.int64)
    shift[4:20], shift[20:30], shift[33:45] = 37, -250, 1000  # request 0: two spans; request 1: one
    rope = RopeSpec(inv_freq_for(D, 100000.0), D, is_neox=True)
    k_cached = k_true.clone()
    k_cached[kv_indices.long()] = shift_keys(k_true[kv_indices.long()], -shift, rope)
    return args, (q, k_cached, v_buf, kv_indices, qo_indptr, kv_indptr), KeyShift(shift, rope), kw


def _leaves(kv_len_total, seed=7):
    """KV leaves over the views batch's keys (``KVLeafRows``): leaf 0 (rank 3) on request 0's
    keys 4:20 (a shifted span) and request 1's keys 33:40 (one leaf read by two requests), leaf 1
    (rank 5) on request 0's keys 24:28 (a second leaf of one request, in another span)."""
    g = torch.Generator().manual_seed(seed)
    leaf = torch.full((kv_len_total,), -1, dtype=torch.int64)
    row = torch.zeros(kv_len_total, dtype=torch.int64)
    leaf[4:20], row[4:20] = 0, torch.arange(16)
    leaf[33:40], row[33:40] = 0, torch.arange(16, 23)
    leaf[24:28], row[24:28] = 1, torch.arange(23, 27).flip(0)
    A_k, A_v = (0.5 * torch.randn(27, 5, generator=g) for _ in range(2))
    B_k, B_v = (0.3 * torch.randn(2, 5, HKV * D, generator=g) for _ in range(2))
    for A, B in ((A_k, B_k), (A_v, B_v)):
        A[:23, 3:] = 0  # leaf 0 has rank 3: its rows and B are zero beyond it
        B[0, 3:] = 0
    return KVLeafRows(leaf, row, A_k, B_k, A_v, B_v)


def leaf_batch(shift: bool):
    """The views batch (key and value LR) with KV leaves (``_leaves``), read with its key shifts
    (``shift``) or at the readers' own positions. Returns (the batch's args, its KeyShift or None,
    the leaves, the args with the corrected keys and values as copies at the readers' positions
    hold them, the LR kwargs)."""
    copies, views, key_shift, kw = views_batch(key_lr=True)
    q, k_cached, v_buf, kv_indices, qo_indptr, kv_indptr = views
    leaves = _leaves(kv_indices.numel())
    slots = kv_indices.long()
    if not shift:  # the pool holds the keys at the readers' positions
        k_cached, key_shift = copies[1], None
        views = (q, k_cached, v_buf, kv_indices, qo_indptr, kv_indptr)
    k_fixed, v_fixed = k_cached.clone(), v_buf.clone()
    has = leaves.leaf >= 0
    for buf, A, B in ((k_fixed, leaves.A_k, leaves.B_k), (v_fixed, leaves.A_v, leaves.B_v)):
        buf[slots[has]] += torch.einsum("nr,nrc->nc", A[leaves.row[has]], B[leaves.leaf[has]]).view(-1, HKV, D)
    if shift:
        k_fixed[slots] = shift_keys(k_fixed[slots], key_shift.shift, key_shift.rope)
    return views, key_shift, leaves, (q, k_fixed, v_fixed, kv_indices, qo_indptr, kv_indptr), kw
