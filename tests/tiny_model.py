"""A tiny random-weight Llama for plumbing and exactness tests (never for quality claims).

It borrows the default model's tokenizer (with its chat template), so prompts and segment
tokenisation behave as on the real model.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Optional

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def build_tiny_llama(
    out_dir: Path, tokenizer_dir: str, rope_scaling: Optional[dict] = None, seed: int = 0, num_layers: int = 2
) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        rope_scaling=rope_scaling,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    # larger weights than the default init, so attention patterns depend strongly on context
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.normal_(0.0, 0.15)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    for name in TOKENIZER_FILES:
        src = Path(tokenizer_dir) / name
        if src.exists():
            shutil.copy(src, out_dir / name)
    return str(out_dir)


def build_tiny_adapter(model_dir: str, out_dir: Path, seed: int, rank: int = 4) -> str:
    """A random PEFT LoRA adapter (q_proj, v_proj) for the tiny Llama; B is non-zero so it acts."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    base = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.5)
    model.save_pretrained(str(out_dir))
    return str(out_dir)
