"""Exact RoPE re-alignment of cached keys (default and llama3 RoPE, NeoX and GPT-J layouts)."""

from sglang_kvshare.rope.align import RopeSpec, inv_freq_for, rotate_keys_, shift_keys
from sglang_kvshare.rope.from_model import rope_spec_for_model

__all__ = ["RopeSpec", "inv_freq_for", "rope_spec_for_model", "rotate_keys_", "shift_keys"]
