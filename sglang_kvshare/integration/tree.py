"""The ``kvshare`` radix-cache backend: SGLang's classic radix tree plus source bookkeeping.

Every annotated request keeps its KV under its own namespace (``extra_key`` =
``WireSpec.namespace``), so approximate (injected) KV never serves a plain request or another
agent as an ordinary prefix hit. When a request is released, the tree records where each of its
shared slots, and its generated output (slot ``out:<agent>``), now sit in the tree, so later
agents of the workflow can find them as injection sources.
"""

from __future__ import annotations

import logging
from array import array
from pathlib import Path
from typing import Optional

import torch
from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
from sglang.srt.mem_cache.registry import (
    TreeCacheBuildContext,
    get_radix_cache_factory,
    register_radix_cache_backend,
)

from sglang_kvshare.integration.kv_io import stack_kv
from sglang_kvshare.integration.own_lr import drop_kept, keep_for_rebuild
from sglang_kvshare.integration.plugin import session
from sglang_kvshare.integration.sharing import family_of
from sglang_kvshare.segments.sources import SourceRecord

logger = logging.getLogger(__name__)

BACKEND_NAME = "kvshare"


def output_slot(agent: str) -> str:
    return f"out:{agent}"


class KVShareRadixCache(RadixCache):
    """Radix tree whose released annotated requests become injection sources."""

    def find_source(self, rec: SourceRecord, num_tokens: int):
        """Locate ``num_tokens`` of a source slot in the tree.

        Returns (node, indices [n] int64) with n <= num_tokens the cached length of the slot, or
        None when the slot's start is not cached any more. The caller must ``lock(node)`` before
        allocating, and may use ``indices`` only while it holds the lock.
        """
        end = min(rec.start + num_tokens, rec.end)
        key = RadixKey(array("q", rec.token_ids[:end]), extra_key=rec.namespace)
        match = self.match_prefix(MatchPrefixParams(key=key))
        cached = match.device_prefix_len - rec.start
        if cached <= 0:
            return None
        node = match.last_device_node
        indices = self.path_device_indices(node)[rec.start : rec.start + cached]
        return node, indices

    def checkpoint(self, req, *, up_to: int):
        """Stock insert; under ``baseshared`` the agent's own LR column of tokens it recomputed
        moves onto the slots the tree already held (the base K/V stay the first agent's)."""
        lr = session().lr
        st = session().lookup(req)
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

    def on_release(self, req, *, checkpointed: bool) -> None:
        super().on_release(req, checkpointed=checkpointed)
        ctx = session()
        st = ctx.forget(req)
        if st is None:
            return
        done = req.finished() and req.finished_reason is not None
        aborted = type(req.finished_reason).__name__ == "FINISH_ABORT"
        if done:
            drop_kept(st)  # a finished ReBaseShared LP rebuild: its kept column was put
        if done and not aborted and not checkpointed:
            keep_for_rebuild(self, req, st)  # ReBaseShared LP: the adapted turn's own LR column
        if not (done and checkpointed) or aborted:
            st.refresh_meta()
            return
        spec = st.spec
        owned = req.owned_kv_len()
        family_of(st.method).release(ctx, self, req, st, owned)
        st.refresh_meta()
        if ctx.args.dump_dir:
            self._dump(req, st, owned, ctx.args.dump_dir)
        tokens = tuple(req.full_untruncated_fill_ids[:owned])
        for slot, start, end in _cached_slots(req, st, owned):
            rec = SourceRecord(spec.agent, req.extra_key, tokens[:end], start, end)
            ctx.registry.record(spec.workflow, slot, rec)

    @torch.no_grad()
    def _dump(self, req, st, owned: int, root: str) -> None:
        """Write each cached shared span's K/V ([layers, n, kv_heads, head_dim] float32); with
        the LR cache also its LR columns: ``lr_v`` (and ``lr_k`` with a key LR cache)
        [layers, n, columns, r_max] float32, and ``lr_columns`` {adapter name: column}."""
        pool = self.token_to_kv_pool_allocator.get_kvcache()
        row = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
        spans = _cached_slots(req, st, owned)
        out_dir = Path(root) / _safe(st.spec.workflow) / _safe(st.spec.agent)
        out_dir.mkdir(parents=True, exist_ok=True)
        lr = session().lr
        for slot, start, end in spans:
            idx = row[start:end].to(torch.int64)
            k, v = (t.float() for t in stack_kv(pool, idx, dim=0))
            record = {"k": k, "v": v, "start": start, "token_ids": list(req.full_untruncated_fill_ids[start:end]),
                      "meta": dict(st.meta)}
            if lr is not None:
                record.update(lr.dump_rows(idx))
            torch.save(record, out_dir / f"{_safe(slot)}.pt")


def _cached_slots(req, st, owned: int) -> list[tuple[str, int, int]]:
    """(slot, start, end) of each shared span, and of the output (``out:<agent>``), whose KV
    the first ``owned`` tokens of the released request cover."""
    slots = [(s.slot, s.start, s.end) for s in st.spec.spans if s.shared and s.end <= owned]
    prompt_len = len(req.origin_input_ids)
    if owned > prompt_len:
        slots.append((output_slot(st.spec.agent), prompt_len, owned))
    return slots


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def _factory(ctx: TreeCacheBuildContext):
    if ctx.disable_radix_cache:
        raise ValueError("--radix-cache-backend kvshare needs the radix cache enabled")
    if ctx.is_hybrid_swa or ctx.is_hybrid_ssm or ctx.enable_hierarchical_cache:
        raise ValueError(
            "--radix-cache-backend kvshare supports full-attention models without hierarchical cache"
        )
    tree = KVShareRadixCache(ctx.params)
    session().anchor_file.load()  # warm start (the launcher checked the file already)
    session().anchor_file.install_signal_handlers()
    return tree


def register_tree() -> None:
    if get_radix_cache_factory(BACKEND_NAME) is None:
        register_radix_cache_backend(BACKEND_NAME, _factory)


def tree_of(scheduler) -> Optional[KVShareRadixCache]:
    tree = scheduler.tree_cache
    return tree if isinstance(tree, KVShareRadixCache) else None
