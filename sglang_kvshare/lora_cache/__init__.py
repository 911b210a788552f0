"""LR caches of PReCache (plain torch): shared base KV + per-agent rank-r LR caches.

See ``base`` for the decomposition and layouts, ``attention`` for the Flash-LoRA-Attention
reference, ``schedules`` for what ``prelr_shared`` / ``rebase_shared`` write, and
``sglang_kvshare/kernels/flash_lora_attention.py`` for the Triton kernel.
"""

from sglang_kvshare.lora_cache.attention import (
    attention_probs,
    expand_key_lr,
    flash_lora_attention,
    flash_lora_attention_qkvo,
    lora_attention_naive,
)
from sglang_kvshare.lora_cache.base import (
    LR_KINDS,
    AttentionSpan,
    LoRAProjection,
    LRCacheConfig,
)
from sglang_kvshare.lora_cache.lr import lr_values, stack_adapters
from sglang_kvshare.lora_cache.peft_io import load_peft_adapter
from sglang_kvshare.lora_cache.pool import LRCachePool
from sglang_kvshare.lora_cache.schedules import CACHE_METHODS, LRWrite, prelr_shared, rebase_shared

__all__ = [
    "CACHE_METHODS",
    "LR_KINDS",
    "AttentionSpan",
    "LoRAProjection",
    "LRCacheConfig",
    "LRCachePool",
    "LRWrite",
    "attention_probs",
    "expand_key_lr",
    "flash_lora_attention",
    "flash_lora_attention_qkvo",
    "load_peft_adapter",
    "lora_attention_naive",
    "lr_values",
    "prelr_shared",
    "rebase_shared",
    "stack_adapters",
]
