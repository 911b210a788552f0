"""PReCache's LR cache inside SGLang: the value (and key) LoRA deltas kept as per-agent rank-r columns.

With ``--kvshare-lr-cache`` (and ``--enable-lora``) the KV pool holds base values
``V_base = X W0_v`` for every token, whichever adapter computed it, and an LR pool indexed by the
same slots holds ``s_k X A_k^T`` ([r] per layer) for EVERY resident adapter k, written as ``X`` is
produced. Agent j attends with ``P V_base + (P LR_j) B_j`` (``kvshare_torch`` backend, with
``kernels.flash_lora_attention_paged``: Triton on CUDA, torch SDPA elsewhere), so the value delta
is never materialised and the base cache can serve any agent.

When a loaded adapter adapts ``k_proj`` (QKVO adapters) the keys are split the same way: the KV
pool holds base keys ``K_base = RoPE(X W0_k)`` and a key LR pool holds ``s_k X A_k^T`` of the
k_proj A, pre-RoPE. RoPE is linear, so agent j's key is ``K_base + RoPE(LR^K_j B^K_j)``, the
delta rotated at the key's own position (its index in the request's token row: the position the
model rotated its base key at). The delta cannot be folded after the scores as the value delta
is (the rotation sits between ``B^K`` and ``q``), so attention expands it from rank r per key
(``flash_lora_torch.rotate_key_delta``, or tile by tile in the Triton kernel). Key LR rows carry no
position, so copying them with an injected or moved segment is exact.

The LoRA hooks that write it (``QKVParallelLinearWithLoRA.apply_lora``: :meth:`LRCache.apply_qkv`)
and that make it part of SGLang's memory planning are in ``lora_hooks.py``. The LR buffers are
allocated with the cache, not on first use.

Adapters the LR cache cannot hold (``lora_cache.targets``: e.g. embed_tokens, fused qkv_proj,
rank patterns) are refused by the launcher before SGLang starts and again here, naming them.
"""

from __future__ import annotations

import functools
import re
from typing import Optional

import torch

from sglang_kvshare.integration.cache.kv_io import kv_bytes_per_token
from sglang_kvshare.kernels.flash_lora_torch import KeyLR
from sglang_kvshare.lora_cache.targets import adapts_keys, lr_cache_refusal

_LAYER_RE = re.compile(r"\.layers\.(\d+)\.")


class LRCache:
    """The LR pool of one scheduler process (one model runner); ``session``: the plugin's."""

    def __init__(self, model_runner, session):
        lm = model_runner.lora_manager
        if lm is None:
            raise ValueError("--kvshare-lr-cache needs --enable-lora")
        self.runner = model_runner
        self.session = session
        self.manager = lm
        self.n_slots = lm.max_loras_per_batch
        self.kv_pool = model_runner.token_to_kv_pool
        self.layer_of: dict[int, int] = {}
        for name, mod in model_runner.model.named_modules():
            if type(mod).__name__ == "QKVParallelLinearWithLoRA":
                m = _LAYER_RE.search("." + name + ".")
                if m:
                    self.layer_of[id(mod)] = int(m.group(1))
        self.buffers: dict[int, torch.Tensor] = {}  # layer -> [kv rows, n_slots, max_r]
        # layer -> [n_slots, max_r, kv_dim]: the resident adapters' value B, as last applied
        self.B_v: dict[int, torch.Tensor] = {}
        self.key_buffers: dict[int, torch.Tensor] = {}  # key LR (pre-RoPE), as ``buffers``
        self.B_k: dict[int, torch.Tensor] = {}  # the k_proj B, as ``B_v``
        self.check_adapters()
        for layer in self.layer_of.values():  # all at once, as SGLang allocates its KV pool
            self.buffer(layer, lm.max_lora_rank)
            if self.key_lr:
                self.buffer(layer, lm.max_lora_rank, self.key_buffers)
        self.rope = session.rope_of(model_runner) if self.key_lr else None
        head_dim = self.kv_pool.get_key_buffer(0).shape[-1]
        if (
            self.key_lr
            and model_runner.device == "cuda"
            and not (self.rope.is_neox and self.rope.rotary_dim == head_dim)
        ):
            raise ValueError("the key LR cache's Triton kernel needs neox RoPE over the whole head")

    def check_adapters(self) -> None:
        loras = self.manager.loras
        if len(loras) + 1 > self.n_slots:
            raise ValueError(
                f"--kvshare-lr-cache keeps every adapter resident: --max-loras-per-batch must be at "
                f"least {len(loras) + 1} (adapters + the base model), got {self.n_slots}"
            )
        for uid, lora in loras.items():
            ref = self.manager.lora_refs.get(uid)
            why = lr_cache_refusal(getattr(ref, "lora_name", None) or uid, lora.config.hf_config)
            if why:
                raise ValueError(why)

    @property
    def key_lr(self) -> bool:
        """Whether a loaded adapter adapts k_proj (then every layer keeps key LR columns)."""
        return _keeps_key_lr(self.manager)

    def columns(self, forward_batch) -> torch.Tensor:
        """[bs] int64: the LR column of each request of the batch (-1: the base model)."""
        ids = forward_batch.lora_ids or [None] * forward_batch.batch_size
        slots = self.manager.memory_pool.uid_to_buffer_id
        return torch.tensor([slots[u] if u is not None else -1 for u in ids], dtype=torch.int64)

    def column_of(self, lora_id: Optional[str]) -> int:
        return -1 if lora_id is None else self.manager.memory_pool.uid_to_buffer_id[lora_id]

    def buffer(self, layer: int, max_r: int, pools: Optional[dict] = None) -> torch.Tensor:
        pools = self.buffers if pools is None else pools
        buf = pools.get(layer)
        if buf is None or buf.shape[2] != max_r:
            rows = self.kv_pool.get_value_buffer(layer).shape[0]
            dtype = self.kv_pool.get_value_buffer(layer).dtype
            buf = torch.zeros(rows, self.n_slots, max_r, dtype=dtype, device=self.kv_pool.device)
            pools[layer] = buf
        return buf

    def all_buffers(self) -> list:
        return [*self.buffers.values(), *self.key_buffers.values()]

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.all_buffers())

    def key_lr_of(self, layer: int) -> Optional[KeyLR]:
        """The key LR inputs of ``flash_lora_attention_paged`` for ``layer`` (None: none kept)."""
        buf = self.key_buffers.get(layer)
        return None if buf is None else KeyLR(buf, self.B_k[layer], self.rope)

    @functools.cached_property
    def bytes_per_token(self) -> dict[str, int]:
        """Per cached token (fixed once the pools exist): base K+V bytes, LR bytes of ONE agent's
        column (all layers), the room kept for rebase_shared_lp's own columns, and the bytes
        SGLang's pool sizing counted (K+V, every column and that room)."""
        elem = self.kv_pool.get_value_buffer(0).element_size()
        per_agent = lr_bytes_per_token(self.manager, len(self.layer_of), elem)
        out = {
            "kv_bytes_per_token": kv_bytes_per_token(self.kv_pool),
            "lr_bytes_per_token_per_agent": per_agent,
            "lp_stash_bytes_per_token": lp_stash_bytes(self.session.args.lp_stash_columns, per_agent),
        }
        cell = self.session.lr_pool_cell_bytes
        if cell is not None:
            out["pool_cell_bytes_per_token"] = cell
        return out

    @torch.no_grad()
    def apply_qkv(self, mod, base_output: torch.Tensor, x: torch.Tensor, loc: Optional[torch.Tensor]) -> torch.Tensor:
        """The q LoRA delta as stock (and the k delta unless the key LR is on), no v delta; LR
        values of all resident adapters (value, and key when on) written at KV slots ``loc``
        (the forward's ``out_cache_loc``)."""
        layer = self.layer_of[id(mod)]
        A, B = mod.A_buffer_qkv, mod.B_buffer_qkv  # [slots, 3 max_r, hidden], [slots, q+2kv, max_r]
        off = mod.output_offset_cpu.tolist()  # [0, q, q+kv, q+2kv]
        key = self.key_lr
        B_q = B.clone()
        B_q[:, (off[1] if key else off[2]) : off[3]] = 0
        out = mod.lora_backend.run_qkv_lora(
            x=x,
            qkv_lora_a=A,
            qkv_lora_b=B_q,
            base_output=base_output,
            output_offset=mod.output_offset,
            output_offset_cpu=mod.output_offset_cpu,
            max_qkv_out_dim=mod.max_qkv_out_dim,
        )
        max_r = A.shape[1] // 3
        if loc is None or loc.numel() != x.shape[0]:
            raise RuntimeError(f"LR cache: {x.shape[0]} tokens but {None if loc is None else loc.numel()} KV slots")
        lr = torch.zeros(x.shape[0], self.n_slots, max_r, dtype=x.dtype, device=x.device)
        lr_k = torch.zeros_like(lr) if key else None
        for uid, slot in self.manager.memory_pool.uid_to_buffer_id.items():
            lora = self.manager.loras.get(uid) if uid is not None else None
            if lora is None:
                continue
            r = lora.config.r  # SGLang stacks [A_q; A_k; A_v] at rows [0:r], [r:2r], [2r:3r]
            lr[:, slot, :r] = torch.mm(x, A[slot, 2 * r : 3 * r].T) * lora.scaling
            if key:
                lr_k[:, slot, :r] = torch.mm(x, A[slot, r : 2 * r].T) * lora.scaling
        buf = self.buffer(layer, max_r)
        buf[loc] = lr.to(buf.dtype)
        self.B_v[layer] = B[:, off[2] : off[3]].transpose(1, 2).contiguous()
        if key:
            kbuf = self.buffer(layer, max_r, self.key_buffers)
            kbuf[loc] = lr_k.to(kbuf.dtype)
            self.B_k[layer] = B[:, off[1] : off[2]].transpose(1, 2).contiguous()
        return out

    @torch.no_grad()
    def copy_rows(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """All LR columns of slots ``src`` -> slots ``dst`` (an injected segment keeps the LR
        caches its source computed; LR values carry no position)."""
        for buf in self.all_buffers():
            buf[dst] = buf[src]

    @torch.no_grad()
    def copy_column(self, src: torch.Tensor, dst: torch.Tensor, column: int) -> None:
        """LR column ``column`` of slots ``src`` -> slots ``dst`` in every layer."""
        for buf in self.all_buffers():
            buf[dst, column] = buf[src, column]

    @torch.no_grad()
    def dump_rows(self, slots: torch.Tensor) -> dict:
        """The LR rows of ``slots`` [n] for a debug dump: ``lr_v`` (and ``lr_k`` when a key LR
        is kept) [layers, n, n_slots, max_r] float32 (layers in order), ``lr_columns``
        {adapter name: column}."""
        out = {}
        for name, pools in (("lr_v", self.buffers), ("lr_k", self.key_buffers)):
            if pools:
                out[name] = torch.stack([pools[layer][slots].float().cpu() for layer in sorted(pools)])
        refs = self.manager.lora_refs
        out["lr_columns"] = {
            str(getattr(refs.get(uid), "lora_name", None) or uid): col
            for uid, col in self.manager.memory_pool.uid_to_buffer_id.items()
            if uid is not None
        }
        return out


def lr_bytes_per_token(manager, num_layers: int, elem_size: int) -> int:
    """LR bytes one cached token takes in ONE agent's LR column (the LoRA memory pool keeps
    ``max_loras_per_batch`` of them), all layers: value LR, and key LR too when an adapter adapts
    k_proj."""
    return num_layers * manager.max_lora_rank * elem_size * (2 if _keeps_key_lr(manager) else 1)


def lp_stash_bytes(columns: float, per_agent: int) -> int:
    """Bytes per cached token reserved for rebase_shared_lp's kept own LR columns
    (``--kvshare-lp-stash-columns`` ``columns`` of ``per_agent`` bytes)."""
    return int(round(columns * per_agent))


def _keeps_key_lr(manager) -> bool:
    return any(adapts_keys(lora.config.hf_config) for lora in manager.loras.values())


def paged_indices(req_to_token, req_pool_indices, seq_lens, q_lens: list[int]):
    """(kv_indices, qo_indptr, kv_indptr) of a batch, the layout of
    ``kernels.flash_lora_attention``, from SGLang's request-to-token table."""
    lens = [int(n) for n in seq_lens.tolist()]
    kv_indices = torch.cat([req_to_token[req_pool_indices[i], :n] for i, n in enumerate(lens)])
    qo = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32)
    kvp = torch.tensor([0, *lens]).cumsum(0).to(torch.int32)
    dev = req_to_token.device
    return kv_indices.to(torch.int32), qo.to(dev), kvp.to(dev)
