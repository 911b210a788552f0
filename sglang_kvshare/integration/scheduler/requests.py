"""Annotated requests entering and leaving the scheduler's view, and its ``/server_info`` (AROUND
hooks).

- ``Scheduler._add_request_to_queue``: an annotated request that entered the waiting queue is
  admitted (:func:`admit`: its segment state, its method family's adjustments), before any
  scheduling pass matches its prefix.
- ``SchedulerOutputStreamer.is_request_level_customized_info_key``: the ``kvshare`` record is
  emitted once per request into ``meta_info``.
- ``SchedulerInternalStateController.get_internal_state``: ``/server_info`` reports the sharing
  state (``internal_states[i].kvshare``).
- ``SchedulerInternalStateController.set_internal_state``: ``kvshare_save_anchor_pool`` saves
  the anchor pools (warm start, ``anchor_pool_file.py``).
- ``SchedulerMetricsCollector.log_stats`` (AFTER, ``--enable-metrics``): whenever SGLang
  publishes its KV-pool gauges, the ``kvshare_tree_tokens`` and ``kvshare_view_tokens`` gauges
  are set beside them.
"""

from __future__ import annotations

from typing import Optional

from sglang.srt.managers.io_struct import SetInternalStateReqOutput

from sglang_kvshare.correction.warm_start import SAVE_KEY
from sglang_kvshare.integration.hookspec import HookSet
from sglang_kvshare.integration.scheduler.sharing import family_of
from sglang_kvshare.integration.state.request import ReqShareState, wire_spec_of
from sglang_kvshare.methods import get_method
from sglang_kvshare.segments.wire import KEY

HOOKS = HookSet()
_STREAMER = "sglang.srt.managers.scheduler_components.output_streamer.SchedulerOutputStreamer"
_STATE = "sglang.srt.managers.scheduler_components.internal_state.SchedulerInternalStateController"
_GAUGES = {
    "tree_tokens": "KV tokens the radix tree holds (evictable + protected; shared slots once)",
    "view_tokens": "Prompt tokens that live requests attend in a source's slots (KV views)",
}


def admit(ses, req) -> Optional[ReqShareState]:
    """The segment state of an annotated ``Req`` that entered the scheduler's waiting queue,
    created (and the request adjusted by its method family, ``sharing.Family.admit``) unless
    it exists; None if unannotated. Called again when a retracted request re-enters."""
    st = ses.lookup(req)
    if st is not None:
        return st
    spec = wire_spec_of(req)
    if spec is None:
        return None
    ses.keep_memory_for_sharing()
    ses.sort_free_slots()
    st = ReqShareState(spec=spec, method=get_method(spec.method), prompt_len=len(req.origin_input_ids))
    ses.requests[req.rid] = st
    family_of(st.method).admit(ses, req, st)
    req.customized_info = {KEY: [st.refresh_meta()]}
    return st


@HOOKS.around("sglang.srt.managers.scheduler.Scheduler._add_request_to_queue", ("self", "req"))
def add_request_to_queue(ses, original, scheduler, req, *args, **kwargs):
    result = original(scheduler, req, *args, **kwargs)
    if any(r is req for r in reversed(scheduler.waiting_queue)):  # not refused at the door
        admit(ses, req)
    return result


@HOOKS.around(f"{_STREAMER}.is_request_level_customized_info_key", ("self", "key"))
def is_request_level_key(ses, original, streamer, key):
    return key == KEY or original(streamer, key)


@HOOKS.around(f"{_STATE}.get_internal_state", ("self", "recv_req"))
def get_internal_state(ses, original, controller, recv_req):
    """``/server_info``'s internal state of this scheduler, plus ``kvshare``: correction state,
    anchor bytes and budget, observations waiting for their factorisation, and ``tree_tokens``
    (KV tokens the radix tree holds: evictable + protected)."""
    out = original(controller, recv_req)
    ses.observer.collect()
    out.internal_state[KEY] = ses.stats() | {"tree_tokens": tree_tokens(controller.scheduler.tree_cache)}
    return out


def tree_tokens(tree) -> int:
    """KV tokens ``tree`` holds (evictable + protected; with KV views, each shared slot once)."""
    return int(tree.evictable_size() + tree.protected_size())


@HOOKS.after("sglang.srt.observability.metrics_collector.SchedulerMetricsCollector.log_stats", ("self", "stats"))
def log_stats(ses, result, collector, stats, *args, **kwargs):
    """Set the ``kvshare_*`` gauges of this scheduler, labelled like SGLang's own (created at the
    first publish: SGLang chose prometheus_client's multiprocess directory by then)."""
    gauges = getattr(collector, "_kvshare_gauges", None)
    if gauges is None:
        from prometheus_client import Gauge

        gauges = collector._kvshare_gauges = {
            key: Gauge(f"kvshare_{key}", doc, list(collector.labels), multiprocess_mode="mostrecent")
            for key, doc in _GAUGES.items()
        }
    if ses.tree is not None:
        gauges["tree_tokens"].labels(**collector.labels).set(tree_tokens(ses.tree))
    gauges["view_tokens"].labels(**collector.labels).set(ses.view_tokens())


@HOOKS.around(f"{_STATE}.set_internal_state", ("self", "recv_req"))
def set_internal_state(ses, original, controller, recv_req):
    """``kvshare_save_anchor_pool`` in ``/set_internal_state``'s server_args saves the anchor
    pools now (the launcher sends it at shutdown); other keys go to SGLang."""
    requested = dict(recv_req.server_args)
    if SAVE_KEY not in requested:
        return original(controller, recv_req)
    requested.pop(SAVE_KEY)
    ses.observer.collect(wait=True)
    saved = ses.anchor_file.save(wait=True)
    if requested:
        recv_req.server_args = requested
        return SetInternalStateReqOutput(updated=saved and original(controller, recv_req).updated)
    return SetInternalStateReqOutput(updated=saved)
