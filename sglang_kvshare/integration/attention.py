"""``kvshare_torch``: SGLang's torch-native attention with an extend that costs O(new x context).

The stock torch-native extend pads each request's queries to its whole sequence, so an extend of
a few tokens after a long (cached or injected) prefix costs as much as attending the whole
sequence to itself. Here the new queries alone attend to the prefix plus themselves, under a
causal mask shifted by the prefix length. Decode and every other case stay stock.
"""

from __future__ import annotations

import torch
from sglang.srt.layers.attention.attention_registry import register_attention_backend
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.server_args import add_attention_backend_choices
from torch.nn.functional import scaled_dot_product_attention

BACKEND_NAME = "kvshare_torch"


def prefix_causal_mask(q_len: int, prefix_len: int, device) -> torch.Tensor:
    """[q_len, prefix_len + q_len] bool: query i sees keys 0 .. prefix_len + i."""
    q_pos = torch.arange(prefix_len, prefix_len + q_len, device=device)[:, None]
    k_pos = torch.arange(prefix_len + q_len, device=device)[None, :]
    return k_pos <= q_pos


class KVShareTorchAttnBackend(TorchNativeAttnBackend):
    def _run_sdpa_forward_extend(
        self,
        query,
        output,
        k_cache,
        v_cache,
        req_to_token,
        req_pool_indices,
        seq_lens,
        extend_prefix_lens,
        extend_seq_lens,
        encoder_lens=None,
        scaling=None,
        enable_gqa=False,
        causal=False,
        is_cross_attn=False,
        sliding_window_size=None,
    ):
        if encoder_lens is not None or not causal or (
            sliding_window_size is not None and sliding_window_size > -1
        ):
            return super()._run_sdpa_forward_extend(
                query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                extend_prefix_lens, extend_seq_lens, encoder_lens, scaling, enable_gqa, causal,
                is_cross_attn, sliding_window_size,
            )
        # query/output: [T, H, D]; caches: [rows, H_kv, D]
        start_q = 0
        for i in range(seq_lens.shape[0]):
            q_len = int(extend_seq_lens[i])
            prefix_len = int(extend_prefix_lens[i])
            kv_len = int(seq_lens[i])
            tokens = req_to_token[req_pool_indices[i], :kv_len]
            q = query[start_q : start_q + q_len].transpose(0, 1)  # [H, q, D]
            k = k_cache[tokens].transpose(0, 1).to(q.dtype)  # [H_kv, kv, D]
            v = v_cache[tokens].transpose(0, 1).to(q.dtype)
            mask = None if prefix_len == 0 else prefix_causal_mask(q_len, prefix_len, q.device)
            out = scaled_dot_product_attention(
                q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                attn_mask=mask, is_causal=prefix_len == 0,
                scale=scaling, enable_gqa=enable_gqa,
            )
            output[start_q : start_q + q_len] = out.squeeze(0).transpose(0, 1)
            start_q += q_len
        return output


def register_attention() -> None:
    register_attention_backend(BACKEND_NAME)(KVShareTorchAttnBackend)
    add_attention_backend_choices([BACKEND_NAME])
