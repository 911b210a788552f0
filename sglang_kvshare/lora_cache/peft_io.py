"""Read a PEFT LoRA adapter directory into ``LoRAProjection``s (no peft import needed)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Dict, Tuple, Union

import torch

from sglang_kvshare.lora_cache.base import LoRAProjection

_KEY = re.compile(r"layers\.(\d+)\.self_attn\.(q_proj|k_proj|v_proj|o_proj)\.lora_([AB])\.weight$")


def load_peft_adapter(
    path: Union[str, Path], dtype: torch.dtype = torch.float32
) -> Dict[Tuple[int, str], LoRAProjection]:
    """``{(layer, "v_proj"): LoRAProjection, ...}`` for every attention projection the adapter at
    ``path`` (``adapter_config.json`` + ``adapter_model.safetensors``) targets.

    scaling = ``lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``); per-module rank or
    alpha patterns are not supported (raise).
    """
    from safetensors.torch import load_file

    path = Path(path)
    cfg = json.loads((path / "adapter_config.json").read_text())
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise ValueError(f"{path}: rank/alpha patterns are not supported")
    r, alpha = int(cfg["r"]), float(cfg["lora_alpha"])
    scaling = alpha / (r**0.5 if cfg.get("use_rslora") else r)
    tensors = load_file(str(path / "adapter_model.safetensors"))
    parts: Dict[Tuple[int, str], Dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        m = _KEY.search(name)
        if m:
            parts.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = t.to(dtype)
    return {key: LoRAProjection.from_peft(ab["A"], ab["B"], scaling) for key, ab in sorted(parts.items())}
