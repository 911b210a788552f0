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


def build_tiny_adapter(
    model_dir: str, out_dir: Path, seed: int, rank: int = 4, targets: tuple = ("q_proj", "v_proj"), b_std: float = 0.5
) -> str:
    """A random PEFT LoRA adapter (default q_proj, v_proj) for a Llama model (the tiny one, or
    SmolLM2 in ``benchmarks.serving --agent-kind lora-random``); B is non-zero
    (std ``b_std``) so it acts."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    base = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(targets)))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, b_std)
    model.save_pretrained(str(out_dir))
    return str(out_dir)


def without_module(adapter_dir: str, out_dir: Path, module: str) -> str:
    """A copy of a PEFT adapter with ``module``'s LoRA weights removed (a negative control)."""
    import json

    from safetensors.torch import load_file, save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    src = Path(adapter_dir)
    cfg = json.loads((src / "adapter_config.json").read_text())
    cfg["target_modules"] = [t for t in cfg["target_modules"] if t != module]
    (out_dir / "adapter_config.json").write_text(json.dumps(cfg))
    tensors = load_file(str(src / "adapter_model.safetensors"))
    save_file({k: v for k, v in tensors.items() if f".{module}." not in k}, str(out_dir / "adapter_model.safetensors"))
    return str(out_dir)
