"""PReCache's LR cache in SGLang's LoRA path and memory planning (AROUND hooks).

- ``QKVParallelLinearWithLoRA.apply_lora``: the stock q LoRA delta is applied, the v delta (and
  the k delta when the key LR is on) is left out (those B rows are zeroed for the call), and the
  LR values of all resident adapters are written at the forward's ``out_cache_loc``
  (``lr_pool.LRCache.apply_qkv``).
- ``LoRAManager.fetch_new_loras``: every loaded adapter stays resident in the LoRA memory pool,
  so each has a stable buffer slot = its LR column (PreLRShared writes all of them).
- ``ModelRunner.init_lora_manager``: records the LoRA manager (it is created before the KV pool
  is sized).
- ``DefaultPoolConfigurator._compute_cell_size``: adds the LR bytes of every column (and the room
  for ReBaseShared LP's kept columns) to SGLang's bytes per cached token, so a memory budget
  (``--mem-fraction-static``) is split between the KV and LR pools, and a token cap
  (``--max-total-tokens``, the CPU default) counts token slots that each hold their KV and LR bytes.
"""

from __future__ import annotations

import logging

import torch

from sglang_kvshare.integration.hookspec import HookSet
from sglang_kvshare.integration.model.lr_pool import lp_stash_bytes, lr_bytes_per_token

logger = logging.getLogger(__name__)

HOOKS = HookSet()


@HOOKS.around("sglang.srt.lora.layers.QKVParallelLinearWithLoRA.apply_lora", ("self", "base_output", "x"))
def qkv_apply_lora(ses, original, mod, base_output, x):
    lr = ses.lr
    if lr is None or id(mod) not in lr.layer_of:
        return original(mod, base_output, x)
    fwd = ses.forward  # begun by the kvshare_torch backend, which owns the LR cache
    return lr.apply_qkv(mod, base_output, x, None if fwd is None else fwd.batch.out_cache_loc)


@HOOKS.around("sglang.srt.lora.lora_manager.LoRAManager.fetch_new_loras", ("self", "new_loras", "running_loras"))
def fetch_new_loras(ses, original, manager, new_loras, running_loras=set()):
    lr = ses.lr
    if lr is not None and lr.manager is manager:
        every = set(new_loras) | set(running_loras) | set(manager.loras) | {None}
        if len(every) <= lr.n_slots:
            new_loras = every
        else:  # an adapter loaded at run time beyond the slots: its LR column is not kept
            logger.warning(
                "kvshare LR cache: %d adapters do not fit %d slots; LR columns of "
                "non-resident adapters are not written",
                len(every) - 1,
                lr.n_slots,
            )
    return original(manager, new_loras, running_loras)


@HOOKS.around("sglang.srt.model_executor.model_runner.ModelRunner.init_lora_manager", ("self",))
def init_lora_manager(ses, original, runner, *args, **kwargs):
    out = original(runner, *args, **kwargs)
    if ses.args.lr_cache:
        ses.attach_lora_manager(runner.lora_manager)
    return out


@HOOKS.around(
    "sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator._compute_cell_size",
    ("self", "kvc", "num_layers"),
)
def compute_cell_size(ses, original, configurator, kvc, num_layers, *args, **kwargs):
    cell = original(configurator, kvc, num_layers, *args, **kwargs)
    manager = ses.lora_manager
    if ses.args.lr_cache and manager is not None and cell:
        per_agent = lr_bytes_per_token(manager, num_layers, torch._utils._element_size(kvc.kv_cache_dtype))
        cell += manager.max_loras_per_batch * per_agent + lp_stash_bytes(ses.args.lp_stash_columns, per_agent)
        ses.attach_lr_pool_cell_bytes(cell)
    return cell
