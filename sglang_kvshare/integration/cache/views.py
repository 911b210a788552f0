"""KV views (one copy of a shared context): a later agent reads a shared segment in the source's
KV slots in place instead of a re-rotated copy (``--kvshare-kv-views``, the default).

A view writes the source's slots into the reader's ``req_to_token`` row, so SGLang treats them
as the reader's prefix; two holders (the source's tree node and the reader, later the reader's
tree node) then share one physical slot. :class:`KVViews` keeps, per slot of the token-to-KV pool:

- ``extra``: references beyond the first. The allocator's ``free`` (hooked below) drops one
  reference per occurrence and returns a slot to the free list only when its last holder frees
  it, so every physical slot is freed exactly once, whichever holder goes first.
- ``rope_pos``: the position a shared slot's key carries RoPE for (-1: the position every holder
  reads it at). A reader at position n of a key rotated for n' attends it with its query turned
  back by n - n' (``kernels.offset_attention``); :meth:`KVViews.offsets` gives those shifts for
  any row of slots, so a later prefix hit on a tree node that holds view slots reads them right.

Spans shorter than ``MIN_VIEW_TOKENS`` are copied (``scheduler/inject.py``): a view of them saves
little memory, and attention could not read them in place (shorter runs are gathered, and their
keys would each be turned in every layer and decode step).

With ``--kvshare-leaf-rank`` > 0, ``leaves`` (``leaves.py``) holds the low-rank corrections
that agents read beside shared slots (an accepted KVCMAS correction as view + leaf).

The radix tree counts a shared slot once per node that holds it; ``cache/radix.py`` subtracts the
extra references from its evictable size, so SGLang's accounting (available + evictable +
protected == total when idle) stays exact.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from sglang_kvshare.integration.cache.leaves import KVLeaves
from sglang_kvshare.integration.hookspec import HookSet
from sglang_kvshare.kernels.split_decode import MIN_RUN
from sglang_kvshare.rope import RopeSpec, shift_keys

logger = logging.getLogger(__name__)

HOOKS = HookSet()
MIN_VIEW_TOKENS = MIN_RUN  # shorter shared spans are copied


def viewable(views: Optional["KVViews"], spec, n: int) -> bool:
    """Whether ``n`` unchanged source tokens are read in place by a request with wire ``spec``."""
    return views is not None and spec.kv_views is not False and n >= MIN_VIEW_TOKENS


class KVViews:
    """Reference counts and RoPE positions of the shared slots of one token-to-KV pool with
    ``num_slots`` rows."""

    def __init__(self, num_slots: int, device, leaf_rank: int = 0) -> None:
        self.leaf_rank = leaf_rank
        self.leaves = KVLeaves(num_slots, device) if leaf_rank > 0 else None
        self.rope_pos = torch.full((num_slots,), -1, dtype=torch.int64, device=device)
        self.extra = torch.zeros(num_slots, dtype=torch.int32, device=device)
        self.extra_total = 0  # sum of ``extra``
        self.marked = 0  # slots with a rope position
        self.double_frees = 0

    def clear(self) -> None:
        """Every slot is free again (SGLang's ``/flush_cache``)."""
        self.rope_pos.fill_(-1)
        self.extra.zero_()
        self.extra_total = self.marked = 0
        if self.leaves is not None:
            self.leaves.clear()

    def share(self, slots: torch.Tensor, positions: torch.Tensor) -> None:
        """One more holder reads ``slots`` (distinct, int64) in place; their keys carry RoPE at
        ``positions`` unless a view already marked them (a chain of views keeps the first)."""
        self.extra[slots] += 1
        self.extra_total += slots.numel()
        unset = self.rope_pos[slots] < 0
        self.rope_pos[slots[unset]] = positions.to(self.rope_pos.device)[unset]
        self.marked += int(unset.sum())

    def readable(self, source_agent: str, spec, slots: torch.Tensor) -> bool:
        """Whether a request with wire ``spec`` may read ``slots`` of ``source_agent`` as a view:
        the leaves it would inherit do not collide with its own (``KVLeaves.compatible``)."""
        return self.leaves is None or self.leaves.compatible(source_agent, spec.agent, slots)

    def read_in_place(self, st, slots: torch.Tensor, positions: torch.Tensor, source_agent: str) -> torch.Tensor:
        """Request state ``st`` reads ``slots`` (keys at RoPE ``positions``) of ``source_agent``
        as a view (with that agent's leaves on them, ``readable``); returns them."""
        self.share(slots, positions)
        if self.leaves is not None:
            self.leaves.inherit(source_agent, st.spec.agent, slots)
        st.view_tokens += slots.numel()
        return slots

    def add_leaves(self, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, agent: Optional[str], dim: int):
        """Keys and values gathered from ``slots`` (``[L, n, H, D]`` with ``dim=0``, or
        ``[n, L, H, D]``) as ``agent`` reads them: its leaves added (keys in the slots' RoPE
        frame, before ``align_keys``): added in place to float32 inputs (the callers' gathered
        copies), else into new tensors of the inputs' dtype."""
        if self.leaves is None or agent is None or not self.leaves.has(agent, slots.to(torch.int64)):
            return keys, values
        k, v = keys.float(), values.float()
        self.leaves.add_to(agent, slots.to(torch.int64), k, v, dim=dim)
        return k.to(keys.dtype), v.to(values.dtype)

    def release(self, idx: torch.Tensor) -> torch.Tensor:
        """The slots of ``idx`` (one holder each per occurrence) that no holder keeps any more:
        what the allocator really frees. Their rope positions are cleared."""
        if self.marked == 0 and self.extra_total == 0:
            return idx
        shared = self.extra[idx] > 0
        if not bool(shared.any()):
            self._unmark(idx)
            if self.leaves is not None:
                self.leaves.drop(idx)
            return idx
        slots, counts = torch.unique(idx, return_counts=True)
        extra = self.extra[slots]
        kept = torch.minimum(extra, counts.to(extra.dtype))
        self.extra[slots] = extra - kept
        self.extra_total -= int(kept.sum())
        over = counts - extra.to(counts.dtype)
        if bool((over > 1).any()):  # a slot freed more often than it is held
            self.double_frees += int((over > 1).sum())
            logger.error("kvshare views: %d slots freed more often than held", int((over > 1).sum()))
        freed = slots[over > 0].to(idx.dtype)
        self._unmark(freed)
        if self.leaves is not None:
            self.leaves.drop(freed)
        return freed

    def _unmark(self, slots: torch.Tensor) -> None:
        if self.marked == 0 or slots.numel() == 0:
            return
        marked = self.rope_pos[slots] >= 0
        n = int(marked.sum())
        if n:
            self.rope_pos[slots[marked]] = -1
            self.marked -= n

    def offsets(self, slots: torch.Tensor, start: int = 0) -> Optional[torch.Tensor]:
        """Per slot of a row read at positions ``start``, ``start + 1``, ...: how many positions
        later it is read than its key was rotated for ([n] int64), or None when all are 0."""
        if self.marked == 0 or slots.numel() == 0:
            return None
        pos = self.rope_pos[slots.to(torch.int64)]
        set_ = pos >= 0
        if not bool(set_.any()):
            return None
        at = torch.arange(start, start + slots.numel(), device=pos.device)
        shifts = torch.where(set_, at - pos, torch.zeros_like(pos))
        return shifts if bool(shifts.any()) else None

    def align_keys(self, keys: torch.Tensor, slots: torch.Tensor, start: int, rope: RopeSpec, dim: int) -> torch.Tensor:
        """Keys gathered from ``slots`` (``[n, L, H, D]``, or ``[L, n, H, D]`` with ``dim=0``: the
        layer axis, as ``kv_io.stack_kv``) as
        if each was rotated for its position ``start + i``: view rows re-rotated, others as read."""
        shifts = self.offsets(slots, start)
        if shifts is None:
            return keys
        rows = keys.movedim(1 - dim, 0)  # tokens first
        n = rows.shape[0]
        moved = shift_keys(rows.reshape(n, -1, rows.shape[-1]), shifts.cpu(), rope).reshape(rows.shape)
        return moved.movedim(0, 1 - dim)

    def stats(self) -> dict:
        return {"shared_slot_refs": self.extra_total, "view_slots": self.marked, "double_frees": self.double_frees} | (
            {} if self.leaves is None else self.leaves.stats()
        )


def views_unsupported(model_runner, session):
    """Why the ``kvshare_torch`` backend of ``model_runner`` cannot attend KV views, or None."""
    hf = model_runner.model_config.hf_config
    if model_runner.device != "cpu":
        return "views are attended by the CPU kernels only"
    if session.args.lr_cache:
        return "the LR cache attends its own base K/V"
    if getattr(model_runner, "kv_cache_dtype", None) != getattr(model_runner, "dtype", None):
        return "KV cache dtype differs from the model's"
    if "mrope_section" in (getattr(hf, "rope_scaling", None) or {}):
        return "mrope"
    try:
        session.rope_of(model_runner)
    except RuntimeError as e:
        return str(e)
    return None


@HOOKS.around("sglang.srt.mem_cache.allocator.token.TokenToKVPoolAllocator.free", ("self", "free_index"))
def free(ses, original, allocator, free_index):
    """A holder frees slots: only those no other holder keeps go back to the free list (a
    deferred free group is counted when it ends, in its one ``free`` call)."""
    views = ses.views
    if views is None or allocator.free_group is not None or free_index.numel() == 0:
        return original(allocator, free_index)
    return original(allocator, views.release(free_index))
