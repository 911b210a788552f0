"""The SGLang functions the plugin hooks (its "patches"), and a startup check of their signatures.

The hooks wrap private SGLang names (HookRegistry AROUND/AFTER hooks), so an SGLang upgrade can
rename a target or change its parameters. :func:`check_hook_targets` resolves every hooked
target and compares its leading parameters (and the keywords a hook reads) with what the hook
relies on; a mismatch stops the launcher with the target's name.
"""

from __future__ import annotations

import importlib
import inspect

# target -> (leading parameters the hook passes on / reads, other parameters it reads by name)
REQUIRED_PARAMS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "sglang.srt.managers.schedule_batch.Req._compute_max_prefix_len": (("self", "input_len"), ()),
    "sglang.srt.managers.schedule_policy.PrefillAdder._select_prefill_admission": (("self", "req"), ("has_chunked_req",)),
    "sglang.srt.managers.schedule_policy.PrefillAdder.add_one_req": (("self", "req"), ()),
    "sglang.srt.managers.schedule_policy.PrefillAdder.add_chunked_req": (("self", "req"), ()),
    "sglang.srt.managers.scheduler.Scheduler._get_new_batch_prefill_raw": (("self",), ()),
    "sglang.srt.managers.scheduler.Scheduler._add_request_to_queue": (("self", "req"), ()),
    "sglang.srt.managers.scheduler.Scheduler.handle_generate_request": (("self", "recv_req"), ()),
    "sglang.srt.managers.scheduler_components.output_streamer.SchedulerOutputStreamer."
    "is_request_level_customized_info_key": (("self", "key"), ()),
    "sglang.srt.managers.scheduler_components.output_streamer.SchedulerOutputStreamer.stream_output":
        (("self", "reqs"), ()),
    "sglang.srt.managers.scheduler_components.internal_state.SchedulerInternalStateController."
    "get_internal_state": (("self", "recv_req"), ()),
    "sglang.srt.managers.scheduler_components.internal_state.SchedulerInternalStateController."
    "set_internal_state": (("self", "recv_req"), ()),
    "sglang.srt.managers.tp_worker.TpModelWorker.forward_batch_generation": (("self", "batch"), ()),
    "sglang.srt.managers.tokenizer_manager.TokenizerManager.update_request_meta_info":
        (("self", "meta_info", "state", "customized_info", "index", "finish_reason"), ()),
    "sglang.srt.lora.layers.QKVParallelLinearWithLoRA.apply_lora": (("self", "base_output", "x"), ()),
    "sglang.srt.lora.lora_manager.LoRAManager.fetch_new_loras": (("self", "new_loras", "running_loras"), ()),
    "sglang.srt.model_executor.model_runner.ModelRunner.init_lora_manager": (("self",), ()),
    "sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator._compute_cell_size":
        (("self", "kvc", "num_layers"), ()),
    "sglang.srt.models.llama.LlamaDecoderLayer.forward": (("self", "positions", "hidden_states", "forward_batch"), ()),
}


def hooked_targets() -> list[str]:
    """Every target a module of ``integration/`` registers a hook on."""
    from sglang_kvshare.integration import (double_batch, lr_cache, meta, own_lr, recompute_forward,
                                            scheduler_hooks)

    targets = {meta.TARGET}
    for module in (scheduler_hooks, lr_cache, double_batch, own_lr, recompute_forward):
        targets.update(module.TARGETS.values())
    return sorted(targets)


def resolve(dotted: str):
    """The object a dotted name stands for (the longest importable module, then attributes)."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


def check_hook_targets(targets=None) -> None:
    """Raise ``RuntimeError`` naming the first hooked target that is gone or whose signature no
    longer has the parameters its hook relies on."""
    for target in hooked_targets() if targets is None else targets:
        if target not in REQUIRED_PARAMS:
            raise RuntimeError(f"kvshare: hooked SGLang target {target} has no expected signature")
        try:
            obj = resolve(target)
        except (ImportError, AttributeError) as e:
            raise RuntimeError(f"kvshare: hooked SGLang target {target} does not exist ({e}); "
                               "this plugin supports sglang==0.5.23") from None
        params = list(inspect.signature(obj).parameters)
        leading, named = REQUIRED_PARAMS[target]
        missing = [p for p in named if p not in params]
        if params[: len(leading)] != list(leading) or missing:
            raise RuntimeError(
                f"kvshare: hooked SGLang target {target} has parameters ({', '.join(params)}); its hook "
                f"relies on ({', '.join(leading)}, ...){' and ' + ', '.join(missing) if missing else ''}; "
                "this plugin supports sglang==0.5.23"
            )
