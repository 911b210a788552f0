"""The one hook on ``TpModelWorker.forward_batch_generation`` (AROUND): after the model forward
of a batch, ReBaseShared's steps run in this order:

1. DB twins' sampled tokens are forced to their adapted requests' tokens
   (``double_batch.force_sampled_tokens``; with delayed sampling, when the sample is taken);
2. the adapted agent's own LR column is put where the forward wrote adapter-free rows
   (``own_column.keep_own_columns``: DB twins, LP rebuilds).

Every forward passes here; both steps return at once when no twin or kept column exists.
"""

from __future__ import annotations

from sglang_kvshare.integration.hookspec import HookSet
from sglang_kvshare.integration.scheduler.double_batch import force_sampled_tokens
from sglang_kvshare.integration.scheduler.own_column import keep_own_columns

HOOKS = HookSet()


@HOOKS.around("sglang.srt.managers.tp_worker.TpModelWorker.forward_batch_generation", ("self", "batch"))
def forward_batch_generation(ses, original, worker, batch=None, *args, **kwargs):
    result = original(worker, batch, *args, **kwargs)
    if batch is not None:
        force_sampled_tokens(ses, batch, result)
        keep_own_columns(ses, batch)
    return result
