"""LR caches of PReCache (plain torch): shared base KV + per-agent rank-r LR caches.

See ``base`` for the decomposition and layouts, ``attention`` for the Flash-LoRA-Attention
reference and ``sglang_kvshare/kernels/flash_lora_attention.py`` for the Triton kernel. The LR
pool itself is the engine's (``integration/model/lr_pool.py``); ``tests/lr_cache_sim.py`` simulates it
and what ``prelr_shared`` / ``rebase_shared`` write; ``own_column`` keeps ReBaseShared's
current agent's own LR column from its adapted hidden states.
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
from sglang_kvshare.lora_cache.own_column import OwnLRColumn, own_span
from sglang_kvshare.lora_cache.peft_io import load_peft_adapter

__all__ = [
    "AttentionSpan",
    "LoRAProjection",
    "OwnLRColumn",
    "attention_probs",
    "expand_key_lr",
    "flash_lora_attention",
    "flash_lora_attention_qkvo",
    "load_peft_adapter",
    "lora_attention_naive",
    "lr_values",
    "own_span",
    "stack_adapters",
]
