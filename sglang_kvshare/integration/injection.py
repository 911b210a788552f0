"""Writing a source agent's cached K/V of a shared segment into a request's KV slots.

Called from the scheduler between two prefill chunks of the request (see scheduler_hooks), so
the injected slots count as prefix for the next chunk. Keys are moved to the new positions
with an exact RoPE rotation (``sglang_kvshare.rope``); values are copied.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch
from sglang.srt.mem_cache.allocation import alloc_paged_token_slots_extend, alloc_token_slots

from sglang_kvshare.integration.lr_cache import lr_cache
from sglang_kvshare.kernels.kv_correct import kv_correct
from sglang_kvshare.rope import RopeSpec, inv_freq_for, shift_keys
from sglang_kvshare.segments import Span
from sglang_kvshare.segments.sources import SourceRecord, common_prefix

logger = logging.getLogger(__name__)


def rope_of(model_runner) -> RopeSpec:
    """The model's RoPE, computed once per process (kept in the plugin context)."""
    from sglang_kvshare.integration.state import context

    ctx = context()
    if ctx.rope is None:
        ctx.rope = rope_spec_for_model(model_runner)
    return ctx.rope


def rope_spec_for_model(model_runner) -> RopeSpec:
    """The RoPE the model applied to its cached keys (read off its first attention layer)."""
    rotary = None
    for module in model_runner.model.modules():
        if hasattr(module, "rotary_dim") and hasattr(module, "is_neox_style") and hasattr(module, "base"):
            rotary = module
            break
    if rotary is None:
        raise RuntimeError("kvshare: the model has no rotary embedding module it can re-align")
    cfg = model_runner.model_config.hf_config
    scaling = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None)
    if scaling and scaling.get("rope_type", scaling.get("type")) in (None, "default"):
        scaling = None
    return RopeSpec(
        inv_freq=inv_freq_for(int(rotary.rotary_dim), float(rotary.base), scaling),
        rotary_dim=int(rotary.rotary_dim),
        is_neox=bool(rotary.is_neox_style),
    )


def kv_layers(pool):
    """(k_buffer, v_buffer) per layer of an MHA token-to-KV pool: [rows, kv_heads, head_dim]."""
    for layer_id in range(pool.start_layer, pool.start_layer + pool.layer_num):
        yield pool.get_key_buffer(layer_id), pool.get_value_buffer(layer_id)


@dataclass
class InjectResult:
    num_tokens: int
    source_agent: str
    dst: torch.Tensor  # [num_tokens] KV slots now holding the segment


def injectable_len(req, span: Span, rec: SourceRecord) -> int:
    """Leading tokens of ``span`` that ``rec`` can stand for: equal tokens, and at least one
    prompt token left to compute after them (its logits are needed)."""
    fill = req.full_untruncated_fill_ids
    limit = min(len(span), len(fill) - 1 - span.start)
    if limit <= 0:
        return 0
    return common_prefix(rec.token_ids[rec.start : rec.end], fill[span.start : span.start + limit])


def inject_segment(scheduler, req, span: Span, rec: SourceRecord, num_tokens: int, rope: RopeSpec) -> Optional[InjectResult]:
    """Copy up to ``num_tokens`` of ``rec``'s cached K/V (keys re-aligned) into new slots for
    ``span``; None (nothing changed) when the source is gone or no KV slots can be had."""
    tree = scheduler.tree_cache
    found = tree.find_source(rec, num_tokens)
    if found is None:
        return None
    node, src_idx = found
    lock = tree.lock(node)
    try:
        dst = alloc_slots(scheduler, req, span.start, len(src_idx))
        if dst is None:
            return None
        pool = scheduler.token_to_kv_pool_allocator.get_kvcache()
        src, dst64, delta = src_idx.to(torch.int64), dst.to(torch.int64), span.start - rec.start
        if src.is_cuda:
            for k_buf, v_buf in kv_layers(pool):
                kv_correct(k_buf, v_buf, src, dst64, delta, rope)
        else:
            copy_all_layers(pool, src, dst64, delta, rope)
        lr = lr_cache()
        if lr is not None:
            lr.copy_rows(src, dst64)
    finally:
        tree.unlock(lock)
    return InjectResult(num_tokens=len(src_idx), source_agent=rec.agent, dst=dst)


@torch.no_grad()
def gather_aligned(pool, src: torch.Tensor, delta: int, rope: RopeSpec):
    """K/V of slots ``src`` in every layer, keys moved ``delta`` positions (one RoPE rotation
    for all layers at once): (k, v) each ``[n, num_layers, kv_heads, head_dim]``."""
    layers = list(kv_layers(pool))
    keys = torch.stack([k_buf[src] for k_buf, _ in layers], dim=1)  # [n, L, H, D]
    n, L, H, D = keys.shape
    keys = shift_keys(keys.reshape(n, L * H, D), delta, rope).reshape(n, L, H, D)
    return keys, torch.stack([v_buf[src] for _, v_buf in layers], dim=1)


@torch.no_grad()
def copy_all_layers(pool, src: torch.Tensor, dst: torch.Tensor, delta: int, rope: RopeSpec) -> None:
    """Torch path of the injection copy."""
    keys, values = gather_aligned(pool, src, delta, rope)
    for layer, (k_buf, v_buf) in enumerate(kv_layers(pool)):
        k_buf[dst] = keys[:, layer]
        v_buf[dst] = values[:, layer]


def commit_injection(scheduler, req, start: int, dst: torch.Tensor) -> None:
    """Make slots ``dst`` the request's KV for [start, start + len(dst)) and its new prefix."""
    end = start + len(dst)
    scheduler.req_to_token_pool.write((req.kv.req_pool_idx, slice(start, end)), dst.to(torch.int32))
    req.prefix_len = end
    req.extend_end = end
    req.kv.kv_allocated_len = end
    req.kv.kv_committed_len = end


def alloc_slots(scheduler, req, start: int, n: int) -> Optional[torch.Tensor]:
    """``n`` KV slots continuing the request's row at ``start`` (None when the pool is full)."""
    tree = scheduler.tree_cache
    try:
        if scheduler.page_size == 1:
            return alloc_token_slots(tree, n)
        row = req.kv.req_pool_idx
        device = scheduler.req_to_token_pool.device
        last = scheduler.req_to_token_pool.req_to_token[row, start - 1].reshape(1).to(torch.int64)
        prefix = torch.tensor([start], dtype=torch.int64)
        seq = torch.tensor([start + n], dtype=torch.int64)
        return alloc_paged_token_slots_extend(
            tree, prefix.to(device), prefix, seq.to(device), seq, last, n
        )
    except RuntimeError as e:  # out of KV memory: the segment is computed instead
        logger.warning("kvshare: no KV slots for injection (%s); computing instead", e)
        return None
