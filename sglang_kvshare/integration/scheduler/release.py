"""A request leaves the scheduler: what happens once SGLang's radix cache released it (called by
``cache/radix.py``'s ``on_release``).

A finished, checkpointed annotated request's method family does its release step (observe dense
fallbacks, remember what a baseshared agent processed), its cached shared spans and its output
(``out:<agent>``) become source records of its workflow (its whole sequence too, for automatic
detection), and, with ``--kvshare-dump-dir``, their
K/V are written to disk. ReBaseShared LP keeps the adapted turn's own LR column for its rebuild
and drops a rebuild's kept column when the rebuild is released.
"""

from __future__ import annotations

from sglang_kvshare.integration.scheduler.own_column import drop_kept, keep_for_rebuild
from sglang_kvshare.integration.scheduler.sharing import family_of
from sglang_kvshare.segments.sources import SourceRecord


def release(ses, tree, req, checkpointed: bool) -> None:
    """After ``tree`` released ``req`` (its KV inserted when ``checkpointed``)."""
    st = ses.forget(req)
    if st is None:
        return
    done = req.finished() and req.finished_reason is not None
    aborted = type(req.finished_reason).__name__ == "FINISH_ABORT"
    if done:
        drop_kept(ses, st)  # a finished ReBaseShared LP rebuild: its kept column was put
    if done and not aborted and not checkpointed:
        keep_for_rebuild(ses, tree, req, st)  # ReBaseShared LP: the adapted turn's own LR column
    if not (done and checkpointed) or aborted:
        st.refresh_meta()
        return
    spec = st.spec
    owned = req.owned_kv_len()
    family_of(st.method).release(ses, tree, req, st, owned)
    st.refresh_meta()
    if ses.args.dump_dir:
        tree.dump(req, st, owned, ses.args.dump_dir)
    tokens = tuple(req.full_untruncated_fill_ids[:owned])
    if spec.sequence:  # automatic detection reads it at any offset
        ses.registry.record_sequence(
            spec.workflow, spec.sequence, SourceRecord(spec.agent, req.extra_key, tokens, 0, owned)
        )
    for slot, start, end in st.cached_slots(owned):
        rec = SourceRecord(spec.agent, req.extra_key, tokens[:end], start, end)
        ses.registry.record(spec.workflow, slot, rec)
        ses.reuse.touch(rec.key)  # written: its first reader's wait counts from here
