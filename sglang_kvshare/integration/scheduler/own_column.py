"""ReBaseShared in the engine: the adapted agent's own LR column comes from its adapted states.

The adapter-free pass (DB's twin, LP's rebuild) writes the neutral base K/V and every LR column
from ``X_neut``; the paper keeps agent j's own column ``s_j X_{j,adpt} A_j^T`` from the turn
that ran with adapter j (``lora_cache.own_column``). j's column is ``LRCache.column_of`` of
the adapted request's adapter. Only positions the adapted request computed itself (past its
cached prefix) carry an adapted column j; rows the tree already held are never touched.

- DB: after every forward holding the adapted request or its twin, column j of the positions both
  have computed so far (``TwinPairs.own``: each one's computed positions) is copied from the
  adapted request's rows to the twin's (``req_to_token`` rows, so a twin admitted a batch later
  than its adapted request is covered too; positions the twin computes after the adapted request
  has freed its KV keep the neutral column: it cannot happen while both run in the same batches).
- LP: when a finished adapted turn is released (its slots freed, not yet reused: the tree's
  ``on_release``), column j of its computed rows is kept (``Session.own_columns``, by request id,
  bounded in bytes); the rebuild names that request (``WireSpec.rebuild_of``)
  and, after each forward that writes its rows, the kept column is put onto them (same positions,
  same tokens); the kept column is dropped when the rebuild finishes (one never claimed, when
  newer ones need its room).

:func:`keep_own_columns` runs after every forward (``worker_forward.py``, once the forward wrote
the batch's K/V and LR rows); :func:`keep_for_rebuild` and :func:`drop_kept` when a request is
released (``release.py``).
"""

from __future__ import annotations

import logging

import torch

from sglang_kvshare.lora_cache.own_column import OwnLRColumn, own_span

logger = logging.getLogger(__name__)


def written_positions(batch) -> list[tuple[object, int, int]]:
    """(req, lo, hi): the token positions ``[lo, hi)`` whose KV each request of ``batch`` (a
    ``ScheduleBatch``) writes in its forward."""
    mode = batch.forward_mode
    if not (mode.is_decode() or mode.is_extend()) or batch.seq_lens_cpu is None:
        return []
    lens = [int(n) for n in batch.seq_lens_cpu.tolist()]
    out = [(r, n - 1, n) for r, n in zip(batch.reqs, lens)]  # decode: the fed token's position
    if mode.is_extend():  # MIXED: requests past the extend lists decode
        for i, (p, e) in enumerate(zip(batch.prefix_lens or [], batch.extend_lens or [])):
            out[i] = (batch.reqs[i], int(p), int(p) + int(e))
    return out


def _rows(req_to_token, req, lo: int, hi: int) -> torch.Tensor:
    return req_to_token[req.kv.req_pool_idx, lo:hi].to(torch.int64)


@torch.no_grad()
def keep_own_columns(ses, batch) -> None:
    """After the forward of ``batch``: DB twins get their adapted request's column j on the
    positions both computed; LP rebuilds get the kept column of the turn they rebuild."""
    lr, twins = ses.lr, ses.twins
    if lr is None or not getattr(batch, "reqs", None) or not (len(twins) or len(ses.own_columns)):
        return  # no DB pair and no LP column kept: nothing to put (every forward passes here)
    req_to_token = lr.runner.req_to_token_pool.req_to_token
    pairs = {}
    for req, lo, hi in written_positions(batch):
        if hi <= lo:
            continue
        primary, twin = twins.primary_of(req), twins.twin_of(req)
        if primary is not None or twin is not None:
            twins.wrote(req, lo, hi)
            pair = (primary, req) if primary is not None else (req, twin)
            since = pairs.get(id(pair[0]), (None, lo))[1]
            pairs[id(pair[0])] = (pair, min(since, lo))
            continue
        st = ses.lookup(req)
        kept = ses.own_columns.get(st.spec.rebuild_of) if st is not None and st.spec.rebuild_of else None
        if kept is not None:
            try:
                kept.put(lr.all_buffers(), _rows(req_to_token, req, lo, hi), lo, req.origin_input_ids[lo:hi])
            except ValueError as e:  # the LR buffers were re-made (an adapter of a larger rank)
                logger.warning("rebase_shared_lp: own LR column of %s not put: %s", st.spec.rebuild_of, e)
                ses.own_columns.pop(st.spec.rebuild_of, None)
    for (primary, twin), since in pairs.values():
        if primary.lora_id is None or not (primary.kv.holds_kv and twin.kv.holds_kv):
            continue
        own_p, own_t = twins.own(primary), twins.own(twin)
        span = None if own_p is None or own_t is None else own_span(own_p, own_t, since=since)
        if span is not None:
            lo, hi = span
            lr.copy_column(
                _rows(req_to_token, primary, lo, hi), _rows(req_to_token, twin, lo, hi), lr.column_of(primary.lora_id)
            )


@torch.no_grad()
def keep_for_rebuild(ses, tree, req, st) -> None:
    """LP: keep column j of a finished adapted turn's computed rows for its rebuild. Called from
    the tree's ``on_release``: the row is freed but no slot is reused yet."""
    lr = ses.lr
    if lr is None or req.lora_id is None or st.method.lr_sharing != "rebase_lp" or not ses.args.lp_stash_columns:
        return
    lo, hi = req.kv.cache_protected_len, req.owned_kv_len()
    if hi <= lo or req.kv.req_pool_idx is None:
        return
    row = tree.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
    tokens = (list(req.origin_input_ids) + list(req.output_ids))[lo:hi]
    kept = OwnLRColumn.take(lr.all_buffers(), row[lo:hi].to(torch.int64), lr.column_of(req.lora_id), lo, tokens)
    try:
        ses.own_columns[req.rid] = kept
    except ValueError:  # larger than the whole bound
        logger.warning(
            "rebase_shared_lp: the own LR column of %s (%d bytes) is not kept; its rebuild "
            "writes that column from adapter-free states",
            req.rid,
            kept.nbytes(),
        )


def drop_kept(ses, st) -> None:
    """LP: the rebuild named by ``st`` is released; its kept column is not needed any more."""
    if st.spec.rebuild_of:
        ses.own_columns.pop(st.spec.rebuild_of, None)
