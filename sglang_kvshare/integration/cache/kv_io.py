"""Reading and writing K/V in SGLang's token-to-KV pool: the one way the sharing methods touch
a source cache (:func:`read_source`: find, lock, gather, unlock) and the request's slots."""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
from sglang.srt.mem_cache.allocation import alloc_paged_token_slots_extend, alloc_token_slots
from sglang.srt.mem_cache.common import evict_from_tree_cache

from sglang_kvshare.correction import SegmentKV
from sglang_kvshare.kernels.kv_correct import kv_correct
from sglang_kvshare.lowrank import LowRank
from sglang_kvshare.rope import RopeSpec, rotate_keys_, shift_keys
from sglang_kvshare.segments.sources import SourceRecord

logger = logging.getLogger(__name__)


@dataclass
class InjectResult:
    """A shared segment now held in the request's slots ``dst`` (committed as prefix)."""

    num_tokens: int
    source_agent: str
    dst: torch.Tensor  # [num_tokens] KV slots now holding the segment


def kv_layers(pool):
    """(k_buffer, v_buffer) per layer of an MHA token-to-KV pool: [rows, kv_heads, head_dim]."""
    for layer_id in range(pool.start_layer, pool.start_layer + pool.layer_num):
        yield pool.get_key_buffer(layer_id), pool.get_value_buffer(layer_id)


def stack_kv(
    pool, idx: torch.Tensor, dim: int = 1, dtype: Optional[torch.dtype] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of slots ``idx`` in every layer, stacked along ``dim`` (1: ``[n, L, H, D]``,
    0: ``[L, n, H, D]``), in ``dtype`` (default: the pool's). Each layer's rows are written
    straight into the result (``index_select`` into it where the layout and dtype allow:
    advanced indexing and a copy measured 5x slower on fragmented slots of a 2K segment)."""
    layers = list(kv_layers(pool))

    def empty(buf):
        shape = [len(idx), *buf.shape[1:]]
        shape.insert(dim, len(layers))
        return torch.empty(shape, dtype=dtype or buf.dtype, device=buf.device)

    k, v = empty(layers[0][0]), empty(layers[0][1])
    for layer, bufs in enumerate(layers):
        for out, buf in zip((k.select(dim, layer), v.select(dim, layer)), bufs):
            if out.is_contiguous() and out.dtype == buf.dtype:
                torch.index_select(buf, 0, idx, out=out)
            else:
                out.copy_(buf[idx])
    return k, v


@contextmanager
def read_source(tree, rec: SourceRecord, num_tokens: int, *, whole: bool = False) -> Iterator[Optional[torch.Tensor]]:
    """The slots (int64) holding up to ``num_tokens`` of source ``rec``, locked in the tree while
    the ``with`` block reads (gathers) or copies them; None when the source is not cached any
    more (or, with ``whole``, holds fewer than ``num_tokens``)."""
    found = tree.find_source(rec, num_tokens)
    if found is None or (whole and len(found[1]) < num_tokens):
        yield None
        return
    node, idx = found
    lock = tree.lock(node)
    try:
        yield idx.to(torch.int64)
    finally:
        tree.unlock(lock)


def _moved(keys: torch.Tensor, delta: int, rope: RopeSpec) -> torch.Tensor:
    """``keys`` [..., H, D] (a tensor the caller owns) moved ``delta`` positions: in place for
    float32 keys (one angle for all of them), else through ``shift_keys``."""
    if keys.dtype == torch.float32:
        return rotate_keys_(keys, delta, rope)
    shape = keys.shape
    return shift_keys(keys.reshape(-1, *shape[-2:]), delta, rope).reshape(shape)


@torch.no_grad()
def gather_aligned(
    pool, src: torch.Tensor, start: int, delta: int, rope: RopeSpec, views=None, agent: Optional[str] = None
):
    """K/V of slots ``src`` (a segment at ``start``, as ``agent`` reads it) in every layer, keys
    moved ``delta`` positions (one RoPE rotation for all layers at once; ``views``' rows first
    brought to ``start + i``, the agent's KV leaves added): (k, v) each
    ``[n, num_layers, kv_heads, head_dim]``."""
    keys, values = stack_kv(pool, src)
    if views is not None:
        keys, values = views.add_leaves(keys, values, src, agent, dim=1)
        keys = views.align_keys(keys, src, start, rope, dim=1)
    return _moved(keys, delta, rope), values


@torch.no_grad()
def gather_canonical(
    pool, idx: torch.Tensor, start: int, rope: RopeSpec, views=None, agent: Optional[str] = None
) -> SegmentKV:
    """K/V of slots ``idx`` (a segment that starts at ``start``, as ``agent`` reads it: with its
    KV leaves) as float32 [L, n, H*D], keys at 0 (float32 so that the rotation, the correction
    and the write each round once, in place)."""
    idx = idx.to(torch.int64)
    k, v = stack_kv(pool, idx, dim=0, dtype=torch.float32)  # [L, n, H, D]
    L, n, H, D = k.shape
    if views is not None:
        k, v = views.add_leaves(k, v, idx, agent, dim=0)
        k = views.align_keys(k, idx, start, rope, dim=0).contiguous()  # float32 in, float32 out
    k = rotate_keys_(k, -start, rope)
    return SegmentKV(k.view(L, n, H * D), v.view(L, n, H * D))


@torch.no_grad()
def write_layers(pool, dst: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, dim: int = 1) -> None:
    """Write keys and values (``[n, L, H, D]``, or ``[L, n, H, D]`` with ``dim=0``) into slots
    ``dst`` of every layer."""
    for layer, (k_buf, v_buf) in enumerate(kv_layers(pool)):
        k_buf.index_copy_(0, dst, keys.select(dim, layer).to(k_buf.dtype))
        v_buf.index_copy_(0, dst, values.select(dim, layer).to(v_buf.dtype))


@torch.no_grad()
def write_canonical(pool, dst: torch.Tensor, kv: SegmentKV, start: int, rope: RopeSpec) -> None:
    """Write canonical ``kv`` (first ``len(dst)`` rows) into slots ``dst`` at position ``start``
    (keys rotated one layer at a time, in a float32 copy: ``kv`` is not changed)."""
    dst = dst.to(torch.int64)
    n = len(dst)
    for layer, (k_buf, v_buf) in enumerate(kv_layers(pool)):
        H, D = k_buf.shape[1:]
        k = kv.k[layer, :n].to(torch.float32, copy=True).view(n, H, D)
        k_buf.index_copy_(0, dst, rotate_keys_(k, start, rope).to(k_buf.dtype))
        v_buf.index_copy_(0, dst, kv.v[layer, :n].reshape(n, H, D).to(v_buf.dtype))


def kv_bytes_per_token(pool) -> int:
    """K + V bytes one token takes in the KV pool (all layers)."""
    return sum(
        k.shape[1] * k.shape[2] * k.element_size() + v.shape[1] * v.shape[2] * v.element_size()
        for k, v in kv_layers(pool)
    )


def commit_injection(scheduler, req, start: int, dst: torch.Tensor) -> None:
    """Make slots ``dst`` the request's KV for [start, start + len(dst)) and its new prefix."""
    end = start + len(dst)
    scheduler.req_to_token_pool.write((req.kv.req_pool_idx, slice(start, end)), dst.to(torch.int32))
    req.prefix_len = end
    req.extend_end = end
    req.kv.kv_allocated_len = end
    req.kv.kv_committed_len = end


def alloc_slots(scheduler, req, start: int, n: int) -> Optional[torch.Tensor]:
    """``n`` KV slots continuing the request's row at ``start`` (None when the pool is full):
    one contiguous run where the free slots hold one (``contiguous_slots``), else ascending."""
    tree = scheduler.tree_cache
    try:
        if scheduler.page_size == 1:
            run = contiguous_slots(tree, n)
            return run if run is not None else alloc_token_slots(tree, n).sort().values
        row = req.kv.req_pool_idx
        device = scheduler.req_to_token_pool.device
        last = scheduler.req_to_token_pool.req_to_token[row, start - 1].reshape(1).to(torch.int64)
        prefix = torch.tensor([start], dtype=torch.int64)
        seq = torch.tensor([start + n], dtype=torch.int64)
        return alloc_paged_token_slots_extend(tree, prefix.to(device), prefix, seq.to(device), seq, last, n)
    except RuntimeError as e:  # out of KV memory: the segment is computed instead
        logger.warning("kvshare: no KV slots for injection (%s); computing instead", e)
        return None


def keep_free_slots_sorted(allocator) -> None:
    """Make a token allocator keep its free list sorted: SGLang's ``need_sort`` (as for
    disaggregation: freed slots wait in ``release_pages`` and are merged into the free list,
    sorted, when it runs short), and the free list sorted once now. Other allocators (paged,
    hybrid) stay as they are."""
    if allocator.need_sort or allocator.page_size != 1 or not hasattr(allocator, "release_pages"):
        return
    allocator.need_sort = True
    allocator.free_pages = allocator.free_pages.sort().values
    allocator.merge_and_sort_free()


def contiguous_slots(tree, n: int) -> Optional[torch.Tensor]:
    """``n`` consecutive free KV slots, the first such run of the sorted free list (taken out of
    it, after SGLang's eviction made room for ``n``), or None: the allocator does not keep its
    free list sorted (``keep_free_slots_sorted``) or no run is that long. Attention reads a
    run of slots in place and gathers the rest (``kernels.offset_attention``), one attention
    call per run: a profile of 2K-token copies taken from the front of a free list in the order
    evictions left it had ~10x fullshared's samples in the per-run decode attention."""
    allocator = tree.token_to_kv_pool_allocator
    if n <= 0 or not getattr(allocator, "need_sort", False) or allocator.page_size != 1:
        return None
    evict_from_tree_cache(tree, n)
    allocator.merge_and_sort_free()
    free = allocator.free_pages
    if len(free) < n:
        return None
    hits = torch.nonzero(free[n - 1 :] - free[: len(free) - n + 1] == n - 1)  # sorted and unique
    if len(hits) == 0:
        return None
    a = int(hits[0])
    allocator.free_pages = torch.cat((free[:a], free[a + n :]))
    return free[a : a + n]


@torch.no_grad()
def write_fused(
    pool, dst, rows, positions, delta, corrected_len: int, start: int, rope: RopeSpec, first: int = 0
) -> None:
    """``kernels.kv_correct`` per layer for the segment's rows ``first, first + 1, ...``: slot
    ``rows[t]`` (cached at position ``positions[t]``) moved to ``start + first + t``, plus
    ``delta`` (canonical, rows ``:corrected_len``), into ``dst[t]``. The dense delta enters the
    kernel as A = delta, B = I."""
    n = len(dst)
    layers = list(kv_layers(pool))
    H, D = layers[0][0].shape[1:]
    eye = torch.eye(H * D, device=layers[0][0].device)
    src, dst = rows.to(torch.int64).contiguous(), dst.to(torch.int64).contiguous()
    shift = (start + first + torch.arange(n, device=positions.device) - positions).to(torch.int64)
    m = max(corrected_len - first, 0)  # corrected rows among ours
    for layer, (k_buf, v_buf) in enumerate(layers):
        dk = torch.zeros(n, H * D, device=k_buf.device)
        dv = torch.zeros_like(dk)
        dk[:m] = delta.k[layer, first:corrected_len]
        dv[:m] = delta.v[layer, first:corrected_len]
        kv_correct(k_buf, v_buf, src, dst, shift, rope, LowRank(dk, eye), LowRank(dv, eye), start)
