"""Segment-wise prefill inside SGLang's scheduler, through HookRegistry AROUND hooks.

Hooked targets (all resolved by tests/integration/test_hook_targets.py):

- ``Req._compute_max_prefix_len``: before a request holds a KV row, its radix match stops one
  token short of the first shared segment that will be injected.
- ``PrefillAdder._select_prefill_admission``: the first admission is cut at that segment's start
  (a chunked prefill); a request that would need a cut, or that SGLang would chunk, waits while
  another chunked request is unfinished (a chunk cut at a segment leaves chunk budget unused).
- ``PrefillAdder.add_one_req``: after a cut, no further request joins the batch.
- ``PrefillAdder.add_chunked_req``: each later chunk stops at the next segment to inject.
- ``Scheduler._get_new_batch_prefill_raw``: before the adder is built, the chunked request's
  segment starting at its prefix is injected (so the adder's memory budget sees those slots);
  after the batch is formed, every annotated request's computed tokens are counted.
- ``Scheduler._add_request_to_queue``: an annotated request that entered the waiting queue is
  admitted (``Session.admit``: its segment state, its method family's adjustments), before any
  scheduling pass matches its prefix.
- ``SchedulerOutputStreamer.is_request_level_customized_info_key``: the ``kvshare`` record is
  emitted once per request into ``meta_info``.
- ``SchedulerInternalStateController.get_internal_state``: ``/server_info`` reports the sharing
  state (``internal_states[i].kvshare``).
- ``SchedulerInternalStateController.set_internal_state``: ``kvshare_save_anchor_pool`` saves
  the anchor pools (warm start, ``anchor_file.py``).

The stock code then treats the injected slots as prefix: it reads ``req_to_token[row,
:prefix_len]`` and runs the next chunk over the remaining tokens only.
"""

from __future__ import annotations

import logging

from sglang.srt.managers.schedule_policy import AddReqResult, _PrefillAdmission
from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from sglang_kvshare.integration.injection import rope_of
from sglang_kvshare.integration.plugin import session
from sglang_kvshare.integration.sharing import share_pending
from sglang_kvshare.integration.state import META_KEY
from sglang_kvshare.integration.tree import tree_of

logger = logging.getLogger(__name__)

TARGETS = {
    "max_prefix": "sglang.srt.managers.schedule_batch.Req._compute_max_prefix_len",
    "admission": "sglang.srt.managers.schedule_policy.PrefillAdder._select_prefill_admission",
    "add_one": "sglang.srt.managers.schedule_policy.PrefillAdder.add_one_req",
    "add_chunked": "sglang.srt.managers.schedule_policy.PrefillAdder.add_chunked_req",
    "prefill": "sglang.srt.managers.scheduler.Scheduler._get_new_batch_prefill_raw",
    "meta_level": "sglang.srt.managers.scheduler_components.output_streamer."
    "SchedulerOutputStreamer.is_request_level_customized_info_key",
    "internal_state": "sglang.srt.managers.scheduler_components.internal_state."
    "SchedulerInternalStateController.get_internal_state",
    "set_internal_state": "sglang.srt.managers.scheduler_components.internal_state."
    "SchedulerInternalStateController.set_internal_state",
    "queue": "sglang.srt.managers.scheduler.Scheduler._add_request_to_queue",
}

def _max_prefix_len(original, req, input_len):
    limit = original(req, input_len)
    st = session().lookup(req)
    if st is None or req.kv.holds_kv:
        return limit
    cut = st.next_cut(session().registry, after=0)
    if cut is not None:
        limit = min(limit, cut - 1)
    if st.method.lr_sharing == "baseshared" and req.lora_id is not None:
        # LRAgent: the agent's own X.A exists only for context it processed itself
        seen = session().processed_prefix(st.spec.workflow, st.spec.agent, req.full_untruncated_fill_ids)
        limit = min(limit, seen)
    return limit


def _select_admission(original, adder, req, **kwargs):
    admission = original(adder, req, **kwargs)
    if not isinstance(admission, _PrefillAdmission):
        return admission
    if admission.is_chunked and kwargs.get("has_chunked_req"):
        # A chunk stopped at a segment leaves chunk budget that stock SGLang would give a long
        # prompt as a second chunked request; the scheduler tracks one: the prompt waits.
        return AddReqResult.OTHER
    st = session().lookup(req)
    if st is None:
        return admission
    if st.first_prefix_len is None:
        st.first_prefix_len = admission.prefix_len
    cut = st.next_cut(session().registry, after=admission.prefix_len)
    if cut is None or cut >= admission.prefix_len + admission.extend_len:
        return admission
    if kwargs.get("has_chunked_req"):
        return AddReqResult.OTHER  # one chunked request at a time: wait for the next pass
    session().cut_adder = adder
    return _PrefillAdmission(
        admission.prefix_len, cut - admission.prefix_len, 0, True, admission.replay_len
    )


def _add_one_req(original, adder, req, *args, **kwargs):
    result = original(adder, req, *args, **kwargs)
    ctx = session()
    if ctx.cut_adder is adder:
        ctx.cut_adder = None
        return AddReqResult.OTHER
    return result


def _add_chunked_req(original, adder, req):
    st = session().lookup(req)
    if st is not None:
        cut = st.next_cut(session().registry, after=req.prefix_len)
        if cut is not None:
            room = cut - req.prefix_len
            limit = adder.chunked_req_limit
            adder.chunked_req_limit = room if limit is None else min(limit, room)
    return original(adder, req)


def _inject_pending(scheduler) -> None:
    """Share (inject, correct or plan) the chunked request's segment that starts at its prefix."""
    req = scheduler.chunked_req
    ctx = session()
    st = ctx.lookup(req)
    if st is None or tree_of(scheduler) is None:
        return
    share_pending(ctx, scheduler, req, st, _rope(scheduler))


def _rope(scheduler):
    return rope_of(scheduler.tp_worker.model_runner)


def _get_new_batch_prefill_raw(original, scheduler, *args, **kwargs):
    ctx = session()
    ctx.observer.collect()  # anchors factorised beside the scheduler since the last step
    ctx.anchor_file.maybe_save()
    if scheduler.chunked_req is not None:
        _inject_pending(scheduler)
    new_batch, running_batch = original(scheduler, *args, **kwargs)
    if new_batch is not None:
        for req in new_batch.reqs:
            st = ctx.lookup(req)
            if st is not None:
                st.computed_tokens += req.extend_len
                if ctx.lr is not None:
                    st.meta.update(ctx.lr.bytes_per_token, lr_bytes=ctx.lr.nbytes())
                st.refresh_meta()
    return new_batch, running_batch


def _internal_state(original, controller, recv_req):
    """``/server_info``'s internal state of this scheduler, plus ``kvshare``: correction state,
    anchor bytes and budget, observations waiting for their factorisation."""
    out = original(controller, recv_req)
    ctx = session()
    ctx.observer.collect()
    out.internal_state["kvshare"] = ctx.stats()
    return out


def _set_internal_state(original, controller, recv_req):
    """``kvshare_save_anchor_pool`` in ``/set_internal_state``'s server_args saves the anchor
    pools now (the launcher sends it at shutdown); other keys go to SGLang."""
    from sglang.srt.managers.io_struct import SetInternalStateReqOutput

    from sglang_kvshare.integration.anchor_file import SAVE_KEY

    requested = dict(recv_req.server_args)
    if SAVE_KEY not in requested:
        return original(controller, recv_req)
    requested.pop(SAVE_KEY)
    ctx = session()
    ctx.observer.collect(wait=True)
    saved = ctx.anchor_file.save(wait=True)
    if requested:
        recv_req.server_args = requested
        return SetInternalStateReqOutput(updated=saved and original(controller, recv_req).updated)
    return SetInternalStateReqOutput(updated=saved)


def _add_request_to_queue(original, scheduler, req, *args, **kwargs):
    result = original(scheduler, req, *args, **kwargs)
    if any(r is req for r in reversed(scheduler.waiting_queue)):  # not refused at the door
        session().admit(req)
    return result


def _is_request_level_key(original, streamer, key):
    return key == META_KEY or original(streamer, key)


def register_scheduler_hooks() -> None:
    for name, fn in (
        ("max_prefix", _max_prefix_len),
        ("admission", _select_admission),
        ("add_one", _add_one_req),
        ("add_chunked", _add_chunked_req),
        ("prefill", _get_new_batch_prefill_raw),
        ("meta_level", _is_request_level_key),
        ("internal_state", _internal_state),
        ("set_internal_state", _set_internal_state),
        ("queue", _add_request_to_queue),
    ):
        HookRegistry.register(TARGETS[name], fn, HookType.AROUND)
