"""LR caches of PReCache (plain torch): shared base KV + per-agent rank-r LR caches.

See ``base`` for the decomposition and layouts, ``attention`` for the Flash-LoRA-Attention
reference and ``sglang_kvshare/kernels/flash_lora_attention.py`` for the Triton kernel. The LR
pool itself is the engine's (``integration/lr_cache.py``); ``tests/lr_cache_sim.py`` simulates it
and what ``prelr_shared`` / ``rebase_shared`` write.
"""

from sglang_kvshare.lora_cache.attention import (
    attention_probs,
    expand_key_lr,
    flash_lora_attention,
    flash_lora_attention_qkvo,
    lora_attention_naive,
)
from sglang_kvshare.lora_cache.base import AttentionSpan, LoRAProjection
from sglang_kvshare.lora_cache.lr import lr_values, stack_adapters
from sglang_kvshare.lora_cache.peft_io import load_peft_adapter

__all__ = [
    "AttentionSpan",
    "LoRAProjection",
    "attention_probs",
    "expand_key_lr",
    "flash_lora_attention",
    "flash_lora_attention_qkvo",
    "load_peft_adapter",
    "lora_attention_naive",
    "lr_values",
    "stack_adapters",
]
