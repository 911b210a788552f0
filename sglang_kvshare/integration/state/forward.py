"""Per-forward state: what the hooks of one model forward share (scheduler process, model side)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

_UNSET = object()


@dataclass
class ForwardState:
    """What the hooks of one model forward share (``Session.begin_forward``, a new one per
    forward batch):

    - ``shared``: whether any request of the batch takes part in sharing (it has a segment
      state) or the LR cache is on; a plain forward (False) runs SGLang's own layers, and the
      ``kvshare_torch`` backend reads every key at its own position without looking up KV
      views, leaves or recompute plans;
    - ``plan``: the recompute plan the decoder-layer hook builds at the first layer (a
      ``BatchPlan`` or None; unset until then);
    - ``running``: while a layer runs on a row subset, (plan, active rows or None, rows split by
      request or None): which queries the ``kvshare_torch`` backend attends;
    - ``lr_columns``: with the LR cache, the LR column of each request of the batch (-1: the base
      model), which the LoRA hook writes and the attention reads with;
    - ``paged``: the batch's paged KV indices (``lr_cache.paged_indices``), built by the first
      LR attention layer and shared by all the others;
    - ``decode_runs``: in a decode, each request's KV slots as runs (``kernels.split_decode``),
      built by the first attention layer and shared by all the others;
    - ``key_shifts``: with KV views, each request's per-key RoPE offsets (``cache/views.py``);
    - ``key_plans``: with KV views, in an extend, each request's plan of the keys before its
      new tokens (``kernels.offset_attention.key_plan``);
    - ``key_leaves``: with KV leaves, each request's ``KeyLeaf`` or None (``cache/leaves.py``)."""

    batch: Any  # the ForwardBatch
    shared: bool = True
    plan: Any = _UNSET
    running: Optional[tuple] = None
    lr_columns: Any = None  # [bs] int64 tensor
    paged: Optional[tuple] = None  # (kv_indices, qo_indptr, kv_indptr)
    decode_runs: Optional[list] = None  # [bs] SlotRuns, or KeyPlans with KV views
    key_shifts: dict = field(default_factory=dict)  # request index -> per-key RoPE offsets or None
    key_plans: dict = field(default_factory=dict)  # request index -> KeyPlan of its prefix's keys
    key_leaves: dict = field(default_factory=dict)  # request index -> KeyLeaf or None

    @property
    def planned(self) -> bool:
        return self.plan is not _UNSET
