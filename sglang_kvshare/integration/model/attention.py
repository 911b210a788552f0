"""``kvshare_torch``: SGLang's torch-native attention with an extend that costs O(new x context).

Stock pads each request's extend queries to its whole sequence; here the new queries attend the
prefix in place (its long runs) and causally themselves (``kernels.offset_attention``). A decode
of a batch that takes part in sharing attends each request's long runs of KV slots in place
(``kernels.split_decode``); a plain batch (``ForwardState.shared`` False) decodes as stock does.
Keys that are KV views (``cache/views.py``, rotated for other positions) or KV leaves
(``cache/leaves.py``, a low-rank correction per layer) are planned per request by
``model/request_keys.py``. During selective recomputation (``recompute_layer.py``) a layer may run
a subset of the extend's rows, whose queries attend by position (``_forward_rows``).

With ``--kvshare-lr-cache`` the backend owns PReCache's LR pool (``lr_pool.py``): it writes base
K/V as stock and attends with ``P V_base + (P LR_j) B_j`` (Flash-LoRA-Attention), extend and
decode; with a key LR cache (k_proj adapters) agent j's keys are ``K_base + RoPE(LR^K_j B^K_j)``.
"""

from __future__ import annotations

import logging

import torch
from sglang.srt.layers.attention.attention_registry import register_attention_backend
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc
from sglang.srt.server_args import add_attention_backend_choices

from sglang_kvshare.integration.cache.views import views_unsupported
from sglang_kvshare.integration.model.lr_pool import LRCache, paged_indices
from sglang_kvshare.kernels.flash_lora_attention import flash_lora_attention_paged
from sglang_kvshare.integration.model.request_keys import RequestKeys
from sglang_kvshare.kernels.offset_attention import (
    KeyPlan,
    offset_decode_attention,
    offset_extend_attention,
    slot_attention,
)
from sglang_kvshare.kernels.split_decode import split_decode_attention

logger = logging.getLogger(__name__)

BACKEND_NAME = "kvshare_torch"


class KVShareTorchAttnBackend(TorchNativeAttnBackend):
    """``session``: the plugin's session (its forward state, and the LR cache this backend
    creates with ``--kvshare-lr-cache``)."""

    def __init__(self, model_runner, session):
        super().__init__(model_runner)
        self.model_runner = model_runner
        self.session = session
        session.attach_model_runner(model_runner, views_unsupported(model_runner, session))
        self.keys = RequestKeys(session, model_runner)
        self.layer_id = 0  # of the layer now attending (a KV leaf's factors are per layer)
        self.lr = None

    def init_forward_metadata(self, forward_batch):
        super().init_forward_metadata(forward_batch)
        ses = self.session
        fwd = ses.begin_forward(forward_batch)
        if ses.lr is None and ses.args.lr_cache:  # once per process
            ses.attach_lr_cache(LRCache(self.model_runner, ses))
            logger.info("kvshare LR cache: %d adapter columns, %d layers", ses.lr.n_slots, len(ses.lr.layer_of))
        self.lr = ses.lr
        if self.lr is not None:
            fwd.lr_columns = self.lr.columns(forward_batch)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        self.layer_id = layer.layer_id
        fwd = self.session.running_forward(forward_batch)
        running = None if fwd is None else fwd.running
        if running is not None:
            plan, rows, parts = running
            plan.observe_queries(layer, q, rows)
            if rows is not None:
                if self._lr_layer(layer) or layer.is_cross_attention:
                    raise RuntimeError("kvshare: selective recomputation runs without the LR cache")
                return self._forward_rows(q, k, v, layer, forward_batch, save_kv_cache, rows, parts, plan)
        if not self._lr_layer(layer):
            return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
        return self._forward_lr(q, k, v, layer, forward_batch, save_kv_cache, forward_batch.extend_seq_lens_cpu)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        self.layer_id = layer.layer_id
        if not self._lr_layer(layer):
            return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
        return self._forward_lr(q, k, v, layer, forward_batch, save_kv_cache, [1] * forward_batch.batch_size)

    def _forward_rows(self, q, k, v, layer, forward_batch, save_kv_cache, rows, parts, plan):
        """Extend attention of a subset of the batch's rows (selective recomputation): each
        query attends, by position, to every slot of its request up to its own position. The
        other rows are not computed at this layer; their slots hold the reused K/V."""
        dev_rows = rows.to(q.device)
        if save_kv_cache and k is not None and v is not None:
            loc = forward_batch.out_cache_loc[dev_rows]
            self.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc(loc, None), k, v)
        heads, v_dim, scale = layer.tp_q_head_num, layer.v_head_dim, layer.scaling
        q_ = q.reshape(-1, heads, layer.qk_head_dim)
        out = q.new_empty(q_.shape[0], heads, v_dim)
        k_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        v_cache = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
        for i, (start, n, prefix, sel) in enumerate(zip(plan.starts, plan.lens, plan.prefix, parts)):
            if not len(sel):
                continue
            sel = sel.to(q.device)
            q_pos = prefix + dev_rows[sel] - start
            slots = self.req_to_token_pool.req_to_token[forward_batch.req_pool_indices[i], : prefix + n]
            # the keys before the first row in place
            shifts, leaf = self.keys.read(i, slots, own_positions=k_cache.dtype == q.dtype)
            if shifts is not None:
                rope = self.keys.rope()
                out[sel] = offset_extend_attention(
                    q_[sel], k_cache, v_cache, slots, shifts, q_pos, scale, rope, leaf=leaf, layer=layer.layer_id
                )
                continue
            out[sel] = slot_attention(q_[sel], k_cache, v_cache, slots, q_pos, scale, heads != layer.tp_k_head_num)
        return out.reshape(-1, heads * v_dim)

    def _lr_layer(self, layer) -> bool:
        return (
            self.lr is not None
            and layer.layer_id in self.lr.B_v
            and not layer.is_cross_attention
            and (layer.sliding_window_size is None or layer.sliding_window_size < 0)
        )

    def _forward_lr(self, q, k, v, layer, forward_batch, save_kv_cache, q_lens):
        if save_kv_cache and k is not None and v is not None:
            self.token_to_kv_pool.set_kv_buffer(
                layer, KVWriteLoc(forward_batch.out_cache_loc, self.swa_out_cache_loc), k, v
            )
        q_ = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        fwd = self.session.forward_of(forward_batch)
        if fwd.paged is None:
            fwd.paged = paged_indices(
                self.req_to_token_pool.req_to_token,
                forward_batch.req_pool_indices,
                forward_batch.seq_lens,
                [int(n) for n in q_lens],
            )
        kv_indices, qo_indptr, kv_indptr = fwd.paged
        o = flash_lora_attention_paged(
            q_,
            self.token_to_kv_pool.get_key_buffer(layer.layer_id),
            self.token_to_kv_pool.get_value_buffer(layer.layer_id),
            kv_indices,
            qo_indptr,
            kv_indptr,
            self.lr.buffers[layer.layer_id],
            self.lr.B_v[layer.layer_id],
            fwd.lr_columns.to(q.device),
            layer.scaling,
            True,
            key_lr=self.lr.key_lr_of(layer.layer_id),
        )
        return o.reshape(-1, layer.tp_q_head_num * layer.v_head_dim)

    def _run_sdpa_forward_decode(
        self,
        query,
        output,
        k_cache,
        v_cache,
        req_to_token,
        req_pool_indices,
        seq_lens,
        encoder_lens=None,
        scaling=None,
        enable_gqa=False,
        causal=False,
        is_cross_attn=False,
        sliding_window_size=None,
    ):
        # query/output: [bs, H, D]; the slot runs are the same in every layer of the forward
        fwd = self.session.forward
        if fwd is not None and fwd.batch.seq_lens is not seq_lens:
            fwd = None  # not the forward the backend began: plan without keeping it
        if (
            (fwd is not None and not fwd.shared)  # a plain batch decodes as stock does (gathering its slots)
            or encoder_lens is not None
            or causal
            or is_cross_attn
            or query.device.type != "cpu"
            or k_cache.dtype != query.dtype
            or v_cache.dtype != query.dtype
            or (sliding_window_size is not None and sliding_window_size > -1)
        ):
            return super()._run_sdpa_forward_decode(
                query,
                output,
                k_cache,
                v_cache,
                req_to_token,
                req_pool_indices,
                seq_lens,
                encoder_lens,
                scaling,
                enable_gqa,
                causal,
                is_cross_attn,
                sliding_window_size,
            )
        runs = None if fwd is None else fwd.decode_runs
        if runs is None:
            runs = [
                self.keys.decode_parts(i, req_to_token[req_pool_indices[i], : int(n)], seq_lens)
                for i, n in enumerate(seq_lens.tolist())
            ]
            if fwd is not None:
                fwd.decode_runs = runs
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        for i, parts in enumerate(runs):
            if isinstance(parts, KeyPlan):  # the request reads KV views
                output[i] = offset_decode_attention(
                    query[i], k_cache, v_cache, parts, scale, self.keys.rope(), self.layer_id
                )
            else:
                output[i] = split_decode_attention(query[i], k_cache, v_cache, parts, scale)
        return output

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
        if encoder_lens is not None or not causal or (sliding_window_size is not None and sliding_window_size > -1):
            return super()._run_sdpa_forward_extend(
                query,
                output,
                k_cache,
                v_cache,
                req_to_token,
                req_pool_indices,
                seq_lens,
                extend_prefix_lens,
                extend_seq_lens,
                encoder_lens,
                scaling,
                enable_gqa,
                causal,
                is_cross_attn,
                sliding_window_size,
            )
        # query/output: [T, H, D]; caches: [rows, H_kv, D]
        start_q = 0
        for i in range(seq_lens.shape[0]):
            q_len = int(extend_seq_lens[i])
            prefix_len = int(extend_prefix_lens[i])
            kv_len = int(seq_lens[i])
            tokens = req_to_token[req_pool_indices[i], :kv_len]
            # the prefix in place and the extend causal, not under a mask
            shifts, leaf = self.keys.read(i, tokens, seq_lens, prefix_len > 0 and k_cache.dtype == query.dtype)
            if shifts is not None:  # KV views (keys rotated for other positions), leaves
                output[start_q : start_q + q_len] = offset_extend_attention(
                    query[start_q : start_q + q_len],
                    k_cache,
                    v_cache,
                    tokens,
                    shifts,
                    torch.arange(prefix_len, prefix_len + q_len, device=query.device),
                    query.shape[-1] ** -0.5 if scaling is None else scaling,
                    self.keys.rope(),
                    self.keys.prefix_plan(i, tokens[:prefix_len], shifts[:prefix_len], leaf, seq_lens),
                    leaf,
                    self.layer_id,
                )
                start_q += q_len
                continue
            q_pos = None if prefix_len == 0 else torch.arange(prefix_len, kv_len, device=query.device)
            output[start_q : start_q + q_len] = slot_attention(
                query[start_q : start_q + q_len], k_cache, v_cache, tokens, q_pos, scaling, enable_gqa
            )
            start_q += q_len
        return output


def register(session) -> None:
    """``--attention-backend kvshare_torch`` builds a backend that keeps ``session``."""
    register_attention_backend(BACKEND_NAME)(lambda model_runner: KVShareTorchAttnBackend(model_runner, session))
    add_attention_backend_choices([BACKEND_NAME])
