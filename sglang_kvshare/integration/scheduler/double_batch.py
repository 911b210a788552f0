"""ReBaseShared DB: the adapter-free path rides in the same continuous batch as the adapted one.

For every adapted request under ``rebase_shared_db`` the scheduler admits a *twin*: the same
prompt, sampling parameters and radix namespace, without the adapter. Both sit in the waiting
queue one after the other, so they are normally prefilled in one batch and decoded in the same
decode batches. The twin is forced to the adapted path's tokens (its sampled token is replaced
right after sampling, before the token is relayed as the next input), so it processes the same
tokens at the same positions while attending only to the neutral base cache. The adapted request
is not inserted into the tree (``skip_radix_cache_insert``); the twin is, with its adapter-free
K/V, the LR columns the LR hook wrote for every other adapter from its hidden states, and the
adapted agent's own column copied from the adapted rows after each forward (``own_column.py``).
When both are done, the tree holds the same span (prompt and every fed output token) as the lazy-prefill
schedule (``rebase_shared_lp``) builds after the turn.

The twin is never streamed. The adapted request's final output is held until its twin has
finished too (as the paper counts a DB call: complete when both paths finish), so the next
agent's request always finds the rebuilt cache; ``rebuild_tokens`` in its ``meta_info.kvshare``
counts the twin's computed tokens.

Hooked targets (AROUND):

- ``Scheduler.handle_generate_request``: after the adapted request is queued, queue its twin.
- ``SchedulerOutputStreamer.stream_output``: drop twins; hold a finished adapted request until
  its twin finishes.

After sampling (``worker_forward.py``, on ``TpModelWorker.forward_batch_generation``) each twin's
token is forced to the adapted path's token at the same output position
(:func:`force_sampled_tokens`). A twin whose adapted request cannot supply that token (aborted,
or retracted and behind) finishes there; the tree keeps what it rebuilt.
"""

from __future__ import annotations

import copy
import logging
from array import array

import msgspec
from sglang.srt.managers.schedule_batch import FINISH_LENGTH

from sglang_kvshare.integration.hookspec import HookSet
from sglang_kvshare.integration.state.request import wire_spec_of
from sglang_kvshare.methods import get_method
from sglang_kvshare.segments.wire import KEY

logger = logging.getLogger(__name__)

HOOKS = HookSet()
TWIN_SUFFIX = "::kvshare-db"


def is_db_request(recv_req) -> bool:
    """An adapted request under ``rebase_shared_db``."""
    if recv_req.lora_id is None:
        return False
    spec = wire_spec_of(recv_req)
    return spec is not None and get_method(spec.method).lr_sharing == "rebase_db"


def _queued(scheduler, rid: str):
    return next((r for r in reversed(scheduler.waiting_queue) if r.rid == rid), None)


@HOOKS.around("sglang.srt.managers.scheduler.Scheduler.handle_generate_request", ("self", "recv_req"))
def handle_generate_request(ses, original, scheduler, recv_req, *args, **kwargs):
    result = original(scheduler, recv_req, *args, **kwargs)
    if not is_db_request(recv_req):
        return result
    primary = _queued(scheduler, recv_req.rid)
    if primary is None:  # refused (the error went back to the client)
        return result
    twin_req = msgspec.structs.replace(
        recv_req,
        rid=recv_req.rid + TWIN_SUFFIX,
        lora_id=None,
        stream=False,
        input_ids=array("q", recv_req.input_ids),
        sampling_params=copy.copy(recv_req.sampling_params),
    )
    original(scheduler, twin_req, *args, **kwargs)
    twin = _queued(scheduler, twin_req.rid)
    if twin is None:
        logger.warning("rebase_shared_db: the adapter-free twin of %s was not queued", recv_req.rid)
        return result
    ses.twins.pair(primary, twin)
    return result


def _emits_token(req) -> bool:
    """Whether ``req`` commits a sampled token from the current forward."""
    return not req.finished() and not req.is_retracted and req.inflight_middle_chunks <= 0


def force_twin_tokens(ses, reqs, next_token_ids, decoding: bool) -> None:
    """Replace each twin's sampled token (in ``next_token_ids``, one per request, in place) by its
    adapted request's token at the same output position; finish twins that cannot get one."""
    rows = {id(r): i for i, r in enumerate(reqs)}
    for i, twin in enumerate(reqs):
        primary = ses.twins.primary_of(twin)
        if primary is None or not _emits_token(twin):
            continue
        st = ses.requests.get(twin.rid)
        if decoding and st is not None:
            st.computed_tokens += 1  # the token fed in this decode step
        pos = len(twin.output_ids)
        j = rows.get(id(primary))
        if pos < len(primary.output_ids):
            next_token_ids[i] = primary.output_ids[pos]
        elif j is not None and pos == len(primary.output_ids) and _emits_token(primary):
            next_token_ids[i] = next_token_ids[j]
        else:
            twin.to_finish = FINISH_LENGTH(length=pos + 1)
        # the adapted request's record (still emitted after its state is released, when held)
        record = (getattr(primary, "customized_info", None) or {}).get(KEY)
        if record and st is not None:
            record[-1]["rebuild_tokens"] = st.computed_tokens


def force_sampled_tokens(ses, batch, result) -> None:
    """After the forward of ``batch``: its twins' tokens in ``result`` (a forward's output, or
    its delayed sampling) are forced to their adapted requests' tokens."""
    reqs = getattr(batch, "reqs", None)
    if not reqs or not any(ses.twins.primary_of(r) is not None for r in reqs):
        return
    decoding = batch.forward_mode.is_decode()
    if getattr(result, "delay_sample_func", None) is not None:
        sample = result.delay_sample_func

        def sample_and_force():
            out = sample()
            force_twin_tokens(ses, reqs, out.next_token_ids, decoding)
            return out

        result.delay_sample_func = sample_and_force
    elif getattr(result, "next_token_ids", None) is not None:
        force_twin_tokens(ses, reqs, result.next_token_ids, decoding)


@HOOKS.around(
    "sglang.srt.managers.scheduler_components.output_streamer.SchedulerOutputStreamer.stream_output", ("self", "reqs")
)
def stream_output(ses, original, streamer, reqs, *args, **kwargs):
    twins = ses.twins
    if not any(twins.paired(r) for r in reqs):
        return original(streamer, reqs, *args, **kwargs)
    out = []
    for r in reqs:
        primary = twins.primary_of(r)
        if primary is not None:
            if r.finished() and twins.held(primary):
                twins.hold(primary, False)
                out.append(primary)  # the DB call is complete: both paths finished
            continue
        twin = twins.twin_of(r)
        if twin is not None and r.finished() and not twin.finished():
            twins.hold(r)
            continue
        out.append(r)
    return original(streamer, out, *args, **kwargs)
