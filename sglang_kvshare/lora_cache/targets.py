"""Which PEFT LoRA adapters the engine's LR cache (``--kvshare-lr-cache``) can serve.

The LR cache splits what an adapter adds to the KV cache into a shared base part and per-agent
rank-r columns: ``s X A_v`` for ``v_proj`` and ``s X A_k`` for ``k_proj`` (the key delta
``LR_k B_k`` is rotated at its keys' positions when attended). That needs each adapter's q/k/v
parts as SGLang stacks them (``q_proj``, ``k_proj``, ``v_proj``, one rank and one scaling for the
adapter) and a purely additive low-rank delta. Adapters on ``q_proj``, ``o_proj`` and the MLP
projections act on the agent's own new tokens only and run as stock LoRA.

Refused (``lr_cache_refusal`` says why, naming the adapter): any other target module (fused
``qkv_proj`` / ``gate_up_proj`` names, ``embed_tokens``, ``lm_head``, ...), a target given as a
shorthand string (``"all-linear"``), per-module rank or alpha patterns, and DoRA.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Optional, Tuple, Union

SERVED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def target_names(hf_config: dict) -> Union[str, list]:
    """The adapter's target modules as base names (``model.layers.0.self_attn.k_proj`` ->
    ``k_proj``); a shorthand string is returned as it is."""
    targets = hf_config.get("target_modules") or []
    if isinstance(targets, str):
        return targets
    return sorted({str(t).split(".")[-1] for t in targets})


def adapts_keys(hf_config: dict) -> bool:
    targets = target_names(hf_config)
    return not isinstance(targets, str) and "k_proj" in targets


def lr_cache_refusal(name: str, hf_config: dict) -> Optional[str]:
    """None when the LR cache can serve adapter ``name`` (its ``adapter_config.json`` as a dict),
    else a message naming the adapter and what the LR cache cannot hold."""
    head = f"adapter {name!r} cannot be served with --kvshare-lr-cache"
    targets = target_names(hf_config)
    if isinstance(targets, str):
        return (
            f"{head}: target_modules={targets!r} is a shorthand; list the modules (served: {', '.join(SERVED_TARGETS)})"
        )
    other = [t for t in targets if t not in SERVED_TARGETS]
    if other:
        return f"{head}: it adapts {', '.join(other)}; the LR cache serves adapters on {', '.join(SERVED_TARGETS)} only"
    if hf_config.get("rank_pattern") or hf_config.get("alpha_pattern"):
        return f"{head}: it has a per-module rank_pattern/alpha_pattern; the LR cache needs one rank and one scaling per adapter"
    if hf_config.get("use_dora"):
        return f"{head}: DoRA's weight normalisation is not a low-rank additive delta"
    return None


def lora_path_entries(lora_paths: Optional[Iterable]) -> Iterable[Tuple[str, str]]:
    """(name, path) of each ``--lora-paths`` entry: ``name=path``, ``path`` or
    ``{"lora_name": ..., "lora_path": ...}`` (or an object with those attributes)."""
    for entry in lora_paths or []:
        if isinstance(entry, dict):
            yield str(entry.get("lora_name")), str(entry.get("lora_path"))
        elif isinstance(entry, str):
            name, sep, path = entry.partition("=")
            yield (name, path) if sep else (entry, entry)
        else:
            yield str(getattr(entry, "lora_name", entry)), str(getattr(entry, "lora_path", entry))


def check_lora_paths(lora_paths: Optional[Iterable]) -> list:
    """Refusal messages for the ``--lora-paths`` adapters whose ``adapter_config.json`` is on
    this machine (hub ids are checked when SGLang has loaded them, by the LR cache)."""
    problems = []
    for name, path in lora_path_entries(lora_paths):
        cfg = Path(path) / "adapter_config.json"
        if cfg.is_file():
            why = lr_cache_refusal(name, json.loads(cfg.read_text()))
            if why:
                problems.append(why)
    return problems
