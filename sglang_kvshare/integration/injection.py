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

from sglang_kvshare.rope import RopeSpec, inv_freq_for, shift_keys
from sglang_kvshare.segments import Span
from sglang_kvshare.segments.sources import SourceRecord

logger = logging.getLogger(__name__)


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


def _common_prefix(a, b) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def inject_segment(scheduler, req, span: Span, rec: SourceRecord, rope: RopeSpec) -> Optional[InjectResult]:
    """Inject up to ``len(span)`` tokens of ``rec`` at ``span.start`` of ``req``.

    ``req`` must hold its req_to_token row with exactly ``span.start`` tokens of KV
    (``req.prefix_len == span.start``). On success the request's prefix, allocated and committed
    lengths all move to the end of the injected tokens. Returns None (nothing changed) when the
    source is gone, its tokens differ, or no KV slots can be had.
    """
    tree = scheduler.tree_cache
    fill = req.full_untruncated_fill_ids
    # at least one prompt token after the injection must be computed (its logits are needed)
    limit = min(len(span), len(fill) - 1 - span.start)
    src_tokens = rec.token_ids[rec.start : rec.end]
    n = min(limit, _common_prefix(src_tokens, fill[span.start : span.start + limit]))
    if n <= 0:
        return None
    found = tree.find_source(rec, n)
    if found is None:
        return None
    node, src_idx = found
    n = len(src_idx)
    lock = tree.lock(node)
    try:
        dst = _alloc(scheduler, req, span.start, n)
        if dst is None:
            return None
        _copy_kv(scheduler.token_to_kv_pool_allocator.get_kvcache(), src_idx, dst, span.start - rec.start, rope)
    finally:
        tree.unlock(lock)
    row = req.kv.req_pool_idx
    scheduler.req_to_token_pool.write((row, slice(span.start, span.start + n)), dst.to(torch.int32))
    end = span.start + n
    req.prefix_len = end
    req.extend_end = end
    req.kv.kv_allocated_len = end
    req.kv.kv_committed_len = end
    return InjectResult(num_tokens=n, source_agent=rec.agent)


def _alloc(scheduler, req, start: int, n: int) -> Optional[torch.Tensor]:
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


@torch.no_grad()
def _copy_kv(pool, src: torch.Tensor, dst: torch.Tensor, delta: int, rope: RopeSpec) -> None:
    src = src.to(torch.int64)
    dst = dst.to(torch.int64)
    for k_buf, v_buf in kv_layers(pool):
        k_buf[dst] = shift_keys(k_buf[src], delta, rope)
        v_buf[dst] = v_buf[src]
