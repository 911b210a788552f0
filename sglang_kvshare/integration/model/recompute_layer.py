"""Selective recomputation (CacheBlend, DroidSpeak, RelayCaching) inside SGLang's forward:
the model side (the scheduler side is ``scheduler/recompute_jobs.py``).

Scheduler side, between two prefill chunks: a shared segment with a source
cache becomes a ``RecomputeJob`` that holds the source's K/V, keys re-aligned to the request's
positions. Unlike an injection, the segment is not committed as prefix: its tokens are query rows
of the next extend.

Model side, one AROUND hook on the Llama decoder layer, for extend batches that carry a job:

- before the first layer, every job's reused K/V of all layers is written into its rows' slots;
- at layer ``l`` only the rows the plan recomputes at ``l`` run the layer, with every row that
  belongs to no job (the request's private tokens, other requests). The hidden states of the
  other rows pass through untouched and their slots keep the reused K/V, which the recomputed
  queries attend to (Eq. 3). ``kvshare_torch`` attends a row subset by position, and the LoRA
  batch info is narrowed to the same rows;
- CacheBlend and RelayCaching first run the check layers ``[0, CHECK_LAYERS)`` for all segment
  rows, then select from the KV deviation at the last check layer (RelayCaching: times the
  attention mass the request's later tokens give each segment token there). The layer-0 KV of a
  token does not depend on its context, so the deviation is read at layer 1;
- DroidSpeak's layer groups come from its offline profile (``--kvshare-droidspeak-profile``);
  a correction method's partial fallback (``scheduler/correct.py``) fixes its rows too: the
  rejected blocks run every layer, the corrected rows none;
- a row whose recomputation starts at ``l > 0`` enters from the hidden state stored when the
  segment was last prefilled densely (``recompute.hidden_store.HiddenStore``, DroidSpeak's stored
  hidden state).

Each job counts the token-layers it really ran (``recomputed_token_layers``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from sglang.srt.layers.layer_boundary.residual import batch as residual_batch

from sglang_kvshare.integration.cache.kv_io import write_layers
from sglang_kvshare.integration.hookspec import HookSet
from sglang_kvshare.recompute import SelectionInputs, attention_mass, get_selector, token_deviation
from sglang_kvshare.recompute.hidden_store import HiddenStore, StoredHidden
from sglang_kvshare.recompute.job import RecomputeJob

HOOKS = HookSet()

CHECK_LAYERS = 2  # CacheBlend / RelayCaching check pass: layers 0 and 1 for every segment token
NEEDS_HIDDEN = ("droidspeak", "relaycaching")


@dataclass
class Piece:
    """The rows of one job that are in this extend."""

    job: RecomputeJob
    req: int  # index of the request in the batch
    rows: torch.Tensor  # [m] batch rows
    tok: torch.Tensor  # [m] token index within the job
    exec: Optional[torch.Tensor] = None  # bool [num_layers, m]: layers each row runs
    queries: Optional[torch.Tensor] = None  # RelayCaching: later tokens' queries at the check layer
    scaling: Optional[float] = None


@dataclass
class Capture:
    """Rows of a densely computed shared segment whose hidden states are stored."""

    entry: StoredHidden
    rows: torch.Tensor
    tok: torch.Tensor


@dataclass
class BatchPlan:
    pieces: list[Piece]
    captures: list[Capture]
    starts: list[int]  # first batch row of each request
    lens: list[int]
    prefix: list[int]
    num_rows: int
    fwd: Any  # the session's ForwardState of this forward
    runner: Any  # the model runner whose pools the jobs write
    store: HiddenStore
    states: list = field(default_factory=list)  # ReqShareState of the requests with pieces
    pending_captures: list = field(default_factory=list)  # (key, span, req, lo, hi) at layer 0

    @classmethod
    def build(cls, fb, ses) -> Optional["BatchPlan"]:
        if ses.runner is None or not fb.forward_mode.is_extend() or not fb.rids or fb.extend_seq_lens_cpu is None:
            return None
        lens = [int(n) for n in fb.extend_seq_lens_cpu]
        prefix = [int(n) for n in fb.extend_prefix_lens_cpu]
        starts = [sum(lens[:i]) for i in range(len(lens))]
        plan = cls([], [], starts, lens, prefix, sum(lens), ses.forward_of(fb), ses.runner, ses.hidden)
        for i, rid in enumerate(fb.rids):
            st = ses.requests.get(rid)
            if st is None or not (st.jobs or st.method.selector):
                continue
            lo_req, hi_req = prefix[i], prefix[i] + lens[i]
            for job in st.jobs.values():
                if job.k is None:
                    continue  # done (a re-prefill after a retraction computes it densely)
                lo, hi = max(job.start, lo_req), min(job.start + job.n, hi_req)
                if lo < hi:
                    rows = torch.arange(starts[i] + lo - lo_req, starts[i] + hi - lo_req)
                    plan.pieces.append(Piece(job, i, rows, torch.arange(lo - job.start, hi - job.start)))
                    if st not in plan.states:
                        plan.states.append(st)
            if st.method.selector in NEEDS_HIDDEN:
                for idx, span in enumerate(st.spec.spans):
                    if not span.shared or idx in st.jobs or st.modes.get(idx) == "injected":
                        continue
                    lo, hi = max(span.start, lo_req), min(span.end, hi_req)
                    if lo < hi:
                        plan.pending_captures.append(((st.spec.workflow, span.slot), span, i, lo, hi))
        if not plan.pieces and not plan.pending_captures:
            return None
        return plan

    # -- layer 0 ------------------------------------------------------------------------------

    def begin(self, fb, hidden: torch.Tensor, num_layers: int) -> None:
        pool = self.runner.token_to_kv_pool
        for p in self.pieces:
            loc = fb.out_cache_loc[p.rows].to(torch.int64)
            write_layers(pool, loc, p.job.k[:, p.tok].transpose(0, 1), p.job.v[:, p.tok].transpose(0, 1))
            if p.job.plan is not None:  # DroidSpeak
                p.exec = p.job.plan.mask[:, p.tok].to(hidden.device)
            else:  # check pass first; the rest is selected at layer CHECK_LAYERS
                p.exec = torch.zeros(num_layers, len(p.rows), dtype=torch.bool, device=hidden.device)
                p.exec[: min(CHECK_LAYERS, num_layers)] = True
        for key, span, i, lo, hi in self.pending_captures:
            entry = self.store.items.get(key)
            if entry is None or lo == span.start or entry.x.shape[1] != len(span):
                entry = self.store.begin(key, num_layers, len(span), hidden.shape[-1], hidden.dtype, hidden.device)
            rows = torch.arange(self.starts[i] + lo - self.prefix[i], self.starts[i] + hi - self.prefix[i])
            tok = torch.arange(lo - span.start, hi - span.start)
            entry.token_ids[tok] = fb.input_ids[rows].cpu().to(torch.int64)
            self.captures.append(Capture(entry, rows, tok))

    # -- selection ----------------------------------------------------------------------------

    def select(self, p: Piece, fb) -> None:
        """Decide CacheBlend / RelayCaching rows from the check layers' K/V: the reused ones of
        the job and the ones the check pass just wrote into the rows' slots."""
        pool = self.runner.token_to_kv_pool
        loc = fb.out_cache_loc[p.rows].to(torch.int64)
        m = len(p.rows)
        check = range(CHECK_LAYERS)
        reused = tuple(t[:CHECK_LAYERS, p.tok].reshape(CHECK_LAYERS, m, -1).float() for t in (p.job.k, p.job.v))
        fresh = tuple(
            torch.stack([buf(layer)[loc].reshape(m, -1).float() for layer in check])
            for buf in (pool.get_key_buffer, pool.get_value_buffer)
        )
        num_layers = p.job.num_layers
        if p.job.selector == "cacheblend":
            plan = get_selector("cacheblend", check_layers=CHECK_LAYERS).plan(
                p.job.ratio, SelectionInputs(num_layers, m, reused_kv=reused, recomputed_kv=fresh)
            )
        else:
            last = CHECK_LAYERS - 1
            dev = token_deviation((reused[0][last], reused[1][last]), (fresh[0][last], fresh[1][last]))
            att = self.suffix_attention(p, fb, last)
            plan = get_selector("relaycaching").plan(
                p.job.ratio, SelectionInputs(num_layers, m, token_deviation=dev, attention_mass=att)
            )
        p.exec = p.exec | plan.mask.to(p.exec.device)
        p.job.layer_groups = plan.layer_groups

    def suffix_attention(self, p: Piece, fb, layer: int) -> torch.Tensor:
        """Attention the request's later tokens (queries at ``layer``) give each segment row; all
        ones when no later token is in this extend."""
        m = len(p.rows)
        if p.queries is None or len(p.queries) == 0:
            return torch.ones(m)
        i = p.req
        first = self.prefix[i] + int(p.rows[-1]) + 1 - self.starts[i]  # position after the segment
        slots = self.runner.req_to_token_pool.req_to_token[fb.req_pool_indices[i], :first].to(torch.int64)
        keys = self.runner.token_to_kv_pool.get_key_buffer(layer)[slots]
        mass = attention_mass(p.queries, keys, p.scaling)
        return mass[p.job.start + p.tok].cpu()

    def observe_queries(self, layer, q: torch.Tensor, rows: Optional[torch.Tensor]) -> None:
        """From the attention backend: keep the queries RelayCaching scores with."""
        if layer.layer_id != CHECK_LAYERS - 1:
            return
        for p in self.pieces:
            if p.job.selector != "relaycaching":
                continue
            i = p.req
            after = torch.arange(int(p.rows[-1]) + 1, self.starts[i] + self.lens[i])
            batch_rows = rows if rows is not None else torch.arange(self.num_rows)
            pick = torch.isin(batch_rows.cpu(), after)
            p.queries = q.reshape(len(batch_rows), layer.tp_q_head_num, layer.qk_head_dim)[pick.to(q.device)]
            p.scaling = layer.scaling

    # -- one layer ----------------------------------------------------------------------------

    def run_layer(self, original, layer, positions, hidden, fb, args, kwargs):
        lid = layer.self_attn.attn.layer_id
        num_layers = self.runner.token_to_kv_pool.layer_num
        if lid == 0:
            self.begin(fb, hidden, num_layers)
        if self.captures:
            out, res = residual_batch.stream_of(fb).export(hidden)
            x_now = out if res is None else out + res
            for c in self.captures:
                c.entry.x[lid, c.tok] = x_now[c.rows].to(c.entry.x.dtype)
        active = torch.ones(self.num_rows, dtype=torch.bool)
        entries = []
        for p in self.pieces:
            if lid == CHECK_LAYERS and p.job.plan is None:
                self.select(p, fb)
            run = p.exec[lid].cpu()
            active[p.rows[~run]] = False
            p.job.token_layers += int(run.sum())
            if lid > 0:
                starting = run & ~p.exec[lid - 1].cpu()
                if bool(starting.any()):
                    entries.append((p.rows[starting], p.job.hidden.x[lid, p.tok[starting]]))
        if bool(active.all()) and not entries:
            out = self.call(original, layer, positions, hidden, fb, args, kwargs, None)
        else:
            x = residual_batch.fold(hidden, fb).clone()
            for rows, h in entries:
                x[rows.to(x.device)] = h.to(x.dtype)
            rows = torch.nonzero(active).flatten()
            dev_rows = rows.to(x.device)
            xa = residual_batch.set_written(x[dev_rows], fb)
            out = self.call(original, layer, positions[dev_rows], xa, fb, args, kwargs, rows)
            x[dev_rows] = residual_batch.fold(out, fb)
            out = residual_batch.set_written(x, fb)
        if lid == num_layers - 1:
            self.finish()
        return out

    def split(self, rows: torch.Tensor) -> list[torch.Tensor]:
        """Per request of the batch: the indices into ``rows`` of its rows (ascending)."""
        return [torch.nonzero((rows >= s) & (rows < s + n)).flatten() for s, n in zip(self.starts, self.lens)]

    def call(self, original, layer, positions, hidden, fb, args, kwargs, rows):
        parts = None if rows is None else self.split(rows)
        lora = getattr(layer.self_attn.qkv_proj, "lora_backend", None)
        saved = None
        if rows is not None and lora is not None and lora.batch_info is not None:
            saved = lora.batch_info
            lora.batch_info = self.narrow_lora(saved, parts, len(rows))
        self.fwd.running = (self, rows, parts)
        try:
            return original(layer, positions, hidden, fb, *args, **kwargs)
        finally:
            self.fwd.running = None
            if saved is not None:
                lora.batch_info = saved

    def narrow_lora(self, info, parts: list[torch.Tensor], num_rows: int):
        """The LoRA batch info of the active rows only. A LoRA segment is a run of requests with
        the same adapter; each keeps its adapter and shrinks to its active rows."""
        if info.permutation is not None or getattr(info, "seg_indptr_cpu", None) is None:
            raise RuntimeError("kvshare: selective recomputation needs the torch_native LoRA backend")
        per_req = torch.tensor([len(part) for part in parts], dtype=torch.int32)
        seg_of_req = torch.searchsorted(info.seg_indptr_cpu[1:].to(torch.int64), torch.tensor(self.starts), right=True)
        counts = torch.zeros(info.num_segments, dtype=torch.int32).scatter_add_(0, seg_of_req, per_req)
        indptr = torch.zeros(len(counts) + 1, dtype=torch.int32)
        indptr[1:] = torch.cumsum(counts, 0)
        dev = info.seg_lens.device
        return dataclasses.replace(
            info,
            seg_lens=counts.to(dev),
            seg_indptr=indptr.to(dev),
            max_len=int(counts.max()),
            expected_tokens=num_rows,
            seg_lens_cpu=counts,
            seg_indptr_cpu=indptr,
        )

    def finish(self) -> None:
        for c in self.captures:
            c.entry.filled[c.tok] = True
        for p in self.pieces:
            if int(p.tok[-1]) == p.job.n - 1:
                p.job.release()
        for st in self.states:
            st.refresh_meta()


@HOOKS.around(
    "sglang.srt.models.llama.LlamaDecoderLayer.forward", ("self", "positions", "hidden_states", "forward_batch")
)
def decoder_layer_forward(ses, original, layer, positions, hidden_states, forward_batch, *args, **kwargs):
    fwd = ses.forward_of(forward_batch)
    if not fwd.shared:
        return original(layer, positions, hidden_states, forward_batch, *args, **kwargs)
    if not fwd.planned:
        fwd.plan = BatchPlan.build(forward_batch, ses)
    if fwd.plan is None:
        return original(layer, positions, hidden_states, forward_batch, *args, **kwargs)
    return fwd.plan.run_layer(original, layer, positions, hidden_states, forward_batch, args, kwargs)
