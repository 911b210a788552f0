"""The ``kvshare`` radix-cache backend: SGLang's classic radix tree plus source bookkeeping.

Every annotated request keeps its KV under its own namespace (``extra_key`` =
``WireSpec.namespace``), so approximate (injected) KV never serves a plain request or another
agent as an ordinary prefix hit. When a request is released, the scheduler side's release step
(``scheduler/release.py``, handed in by ``plugin.py``) records where each of its shared slots, and
its generated output (slot ``out:<agent>``), now sit in the tree, so later agents of the workflow
can find them here (:meth:`KVShareRadixCache.find_source`) as injection sources.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from array import array
from pathlib import Path
from typing import Callable

import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, EvictResult, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
from sglang.srt.mem_cache.registry import TreeCacheBuildContext

from sglang_kvshare.integration.cache.kv_io import stack_kv
from sglang_kvshare.integration.cache.views import KVViews
from sglang_kvshare.segments.reuse import copies_fit, lru_victims
from sglang_kvshare.segments.sources import SourceRecord

BACKEND_NAME = "kvshare"

logger = logging.getLogger(__name__)


class KVShareRadixCache(RadixCache):
    """Radix tree whose released annotated requests become injection sources. ``session`` is the
    plugin's session; ``released(tree, req, checkpointed)`` runs after SGLang's own release."""

    def __init__(self, params, session, released: Callable) -> None:
        self.session = session  # before the stock constructor, which calls ``reset``
        super().__init__(params)
        self.released = released

    def find_source(self, rec: SourceRecord, num_tokens: int):
        """Locate ``num_tokens`` of a source slot in the tree.

        Returns (node, indices [n] int64) with n <= num_tokens the cached length of the slot, or
        None when the slot's start is not cached any more. The caller must ``lock(node)`` before
        allocating, and may use ``indices`` only while it holds the lock.
        """
        self.session.reuse.touch(rec.key)
        end = min(rec.start + num_tokens, rec.end)
        key = RadixKey(array("q", rec.token_ids[:end]), extra_key=rec.namespace)
        match = self.match_prefix(MatchPrefixParams(key=key))
        cached = match.device_prefix_len - rec.start
        if cached <= 0:
            return None
        node = match.last_device_node
        indices = self.path_device_indices(node)[rec.start : rec.start + cached]
        return node, indices

    def copies_fit(self, rows: int) -> bool:
        """Whether ``rows`` more slots can be had without evicting a source that is read again
        (``segments.reuse.copies_fit``): free slots, or what LRU eviction would take for them
        (``segments.reuse.lru_victims``) older than the reuse horizon. The age compared is the
        youngest victim's, skipping spent ones (a namespace whose every source record a later
        agent superseded); when eviction cannot free enough, nothing fits."""
        free = self.token_to_kv_pool_allocator.available_size()
        if free >= rows:
            return True
        victims = lru_victims(self.evictable_leaves, rows - free, self.eviction_strategy.get_priority)
        if victims is None:
            age = None
        else:
            spent = self.session.registry.spent
            live = [v.last_access_time for v in victims if not spent(v.key.extra_key)]
            age = time.monotonic() - max(live) if live else math.inf
        return copies_fit(free, rows, age, self.session.reuse.horizon())

    def checkpoint(self, req, *, up_to: int):
        """Stock insert; under ``baseshared`` the agent's own LR column of tokens it recomputed
        moves onto the slots the tree already held (the base K/V stay the first agent's)."""
        lr = self.session.lr
        st = self.session.lookup(req)
        if lr is None or st is None or st.method.lr_sharing != "baseshared" or req.lora_id is None:
            return super().checkpoint(req, up_to=up_to)
        row = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
        lo = req.kv.cache_protected_len
        before = row[lo:up_to].clone()
        super().checkpoint(req, up_to=up_to)
        after = row[lo : lo + before.numel()]
        moved = before[: after.numel()] != after
        if bool(moved.any()):
            lr.copy_column(before[: after.numel()][moved].long(), after[moved].long(), lr.column_of(req.lora_id))

    def evictable_size(self):
        """Tokens eviction can free: a slot that KV views share counts once (``cache/views.py``;
        a shared slot a live request holds is not counted, so admission stays conservative)."""
        size = super().evictable_size()
        views = self.session.views
        return size if views is None else max(size - views.extra_total, 0)

    def evict(self, params: EvictParams) -> EvictResult:
        """Stock eviction, repeated while the evicted leaves freed fewer slots than asked for
        (a leaf whose slots KV views share frees none while another holder keeps them)."""
        allocator = self.token_to_kv_pool_allocator
        if self.session.views is None or allocator.free_group is not None:
            return super().evict(params)
        before = allocator.available_size()
        result = super().evict(params)
        total = result.num_tokens_evicted
        while result.num_tokens_evicted and allocator.available_size() - before < params.num_tokens:
            freed = allocator.available_size() - before
            result = super().evict(dataclasses.replace(params, num_tokens=params.num_tokens - freed))
            total += result.num_tokens_evicted
        return dataclasses.replace(result, num_tokens_evicted=total)

    def reset(self):
        super().reset()
        if self.session.views is not None:
            self.session.views.clear()

    def on_release(self, req, *, checkpointed: bool) -> None:
        super().on_release(req, checkpointed=checkpointed)
        self.released(self, req, checkpointed)

    @torch.no_grad()
    def dump(self, req, st, owned: int, root: str) -> None:
        """Write each cached shared span's K/V ([layers, n, kv_heads, head_dim] float32); with
        the LR cache also its LR columns: ``lr_v`` (and ``lr_k`` with a key LR cache)
        [layers, n, columns, r_max] float32, and ``lr_columns`` {adapter name: column}."""
        pool = self.token_to_kv_pool_allocator.get_kvcache()
        row = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
        spans = st.cached_slots(owned)
        out_dir = Path(root) / _safe(st.spec.workflow) / _safe(st.spec.agent)
        out_dir.mkdir(parents=True, exist_ok=True)
        lr = self.session.lr
        for slot, start, end in spans:
            idx = row[start:end].to(torch.int64)
            k, v = stack_kv(pool, idx, dim=0)
            if self.session.views is not None:  # as the request reads them: at its positions, with its leaves
                k, v = self.session.views.add_leaves(k, v, idx, st.spec.agent, dim=0)
                k = self.session.views.align_keys(k, idx, start, self.session.rope, dim=0)
            k, v = k.float(), v.float()
            record = {
                "k": k,
                "v": v,
                "start": start,
                "token_ids": list(req.full_untruncated_fill_ids[start:end]),
                "meta": dict(st.meta),
            }
            if lr is not None:
                record.update(lr.dump_rows(idx))
            torch.save(record, out_dir / f"{_safe(slot)}.pt")


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def build(ctx: TreeCacheBuildContext, session, released: Callable) -> KVShareRadixCache:
    """The tree SGLang's radix-cache registry builds for ``--radix-cache-backend kvshare``."""
    if ctx.disable_radix_cache:
        raise ValueError("--radix-cache-backend kvshare needs the radix cache enabled")
    if ctx.is_hybrid_swa or ctx.is_hybrid_ssm or ctx.enable_hierarchical_cache:
        raise ValueError("--radix-cache-backend kvshare supports full-attention models without hierarchical cache")
    tree = KVShareRadixCache(ctx.params, session, released)
    allocator = ctx.params.token_to_kv_pool_allocator
    why_not = session.views_unsupported or (None if allocator.page_size == 1 else "page size > 1")
    views = None
    if session.args.kv_views and why_not is None:
        views = KVViews(allocator.size + 1, allocator.device, session.args.leaf_rank)  # slot 0 is padding
        logger.info("kvshare KV views on: later agents read shared segments in the source's slots")
    elif session.args.kv_views:
        logger.info("kvshare KV views off (%s): later agents copy shared segments", why_not)
    session.attach_tree(tree, views)
    return tree
