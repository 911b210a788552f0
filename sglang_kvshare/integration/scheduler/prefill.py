"""Segment-wise prefill inside SGLang's scheduler (AROUND hooks).

- ``Req._compute_max_prefix_len``: before a request holds a KV row, its radix match stops one
  token short of the first shared segment that will be injected.
- ``PrefillAdder._select_prefill_admission``: the first admission is cut at that segment's start
  (a chunked prefill); a request that would need a cut, or that SGLang would chunk, waits while
  another chunked request is unfinished (a chunk cut at a segment leaves chunk budget unused).
- ``PrefillAdder.add_one_req``: after a cut, no further request joins the batch.
- ``PrefillAdder.add_chunked_req``: each later chunk stops at the next segment to inject.
- ``Scheduler._get_new_batch_prefill_raw``: before the adder is built, the chunked request's
  segment starting at its prefix is shared (``sharing.share_pending``: injected, corrected or
  planned for recomputation, so the adder's memory budget sees those slots), and the next one if
  it starts where that one, shared wholly, ended; after the batch is
  formed, every annotated request's computed tokens are counted.

A "segment start" here is where its sharing starts (``ReqShareState.share_at``): a correction
method's head rows (``--kvshare-recompute-head``) are computed densely by the chunk before.

The stock code then treats the injected slots as prefix: it reads ``req_to_token[row,
:prefix_len]`` and runs the next chunk over the remaining tokens only.
"""

from __future__ import annotations

from sglang.srt.managers.schedule_policy import AddReqResult, _PrefillAdmission

from sglang_kvshare.integration.cache.radix import KVShareRadixCache
from sglang_kvshare.integration.hookspec import HookSet
from sglang_kvshare.integration.scheduler.sharing import share_pending

HOOKS = HookSet()


@HOOKS.around("sglang.srt.managers.schedule_batch.Req._compute_max_prefix_len", ("self", "input_len"))
def max_prefix_len(ses, original, req, input_len):
    limit = original(req, input_len)
    st = ses.lookup(req)
    if st is None or req.kv.holds_kv:
        return limit
    cut = st.next_cut(ses.registry, after=0, tokens=req.origin_input_ids)
    if cut is not None:
        limit = min(limit, cut - 1)
    if st.method.lr_sharing == "baseshared" and req.lora_id is not None:
        # LRAgent: the agent's own X.A exists only for context it processed itself
        seen = ses.processed_prefix(st.spec.workflow, st.spec.agent, req.full_untruncated_fill_ids)
        limit = min(limit, seen)
    return limit


@HOOKS.around(
    "sglang.srt.managers.schedule_policy.PrefillAdder._select_prefill_admission",
    ("self", "req"),
    reads=("has_chunked_req",),
)
def select_admission(ses, original, adder, req, **kwargs):
    admission = original(adder, req, **kwargs)
    if not isinstance(admission, _PrefillAdmission):
        return admission
    if admission.is_chunked and kwargs.get("has_chunked_req") and ses.requests:
        # A chunk stopped at a segment leaves chunk budget that stock SGLang would give a long
        # prompt as a second chunked request; the scheduler tracks one: the prompt waits.
        return AddReqResult.OTHER
    st = ses.lookup(req)
    if st is None:
        return admission
    if st.first_prefix_len is None:
        st.first_prefix_len = admission.prefix_len
    cut = st.next_cut(ses.registry, after=admission.prefix_len, tokens=req.origin_input_ids)
    if cut is None or cut >= admission.prefix_len + admission.extend_len:
        return admission
    if kwargs.get("has_chunked_req"):
        return AddReqResult.OTHER  # one chunked request at a time: wait for the next pass
    ses.cut_adder = adder
    return _PrefillAdmission(admission.prefix_len, cut - admission.prefix_len, 0, True, admission.replay_len)


@HOOKS.around("sglang.srt.managers.schedule_policy.PrefillAdder.add_one_req", ("self", "req"))
def add_one_req(ses, original, adder, req, *args, **kwargs):
    result = original(adder, req, *args, **kwargs)
    if ses.cut_adder is adder:
        ses.cut_adder = None
        return AddReqResult.OTHER
    return result


@HOOKS.around("sglang.srt.managers.schedule_policy.PrefillAdder.add_chunked_req", ("self", "req"))
def add_chunked_req(ses, original, adder, req):
    st = ses.lookup(req)
    if st is not None:
        cut = st.next_cut(ses.registry, after=req.prefix_len, tokens=req.origin_input_ids)
        if cut is not None:
            room = cut - req.prefix_len
            limit = adder.chunked_req_limit
            adder.chunked_req_limit = room if limit is None else min(limit, room)
    return original(adder, req)


@HOOKS.around("sglang.srt.managers.scheduler.Scheduler._get_new_batch_prefill_raw", ("self",))
def get_new_batch_prefill_raw(ses, original, scheduler, *args, **kwargs):
    ses.observer.collect()  # anchors factorised beside the scheduler since the last step
    ses.anchor_file.maybe_save()
    req = scheduler.chunked_req
    st = None if req is None else ses.lookup(req)
    if st is not None and isinstance(scheduler.tree_cache, KVShareRadixCache):
        rope = ses.rope_of(scheduler.tp_worker.model_runner)
        while True:  # segments back to back: each one shared wholly moves the prefix to the next
            i = share_pending(ses, scheduler, req, st, rope)
            if i is None or i in st.jobs or req.prefix_len != st.spec.spans[i].end:
                break
    new_batch, running_batch = original(scheduler, *args, **kwargs)
    if new_batch is not None:
        for req in new_batch.reqs:
            st = ses.lookup(req)
            if st is not None:
                st.computed_tokens += req.extend_len
                if ses.lr is not None:
                    st.meta.update(ses.lr.bytes_per_token, lr_bytes=ses.lr.nbytes())
                st.refresh_meta()
    return new_batch, running_batch
