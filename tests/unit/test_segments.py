import pytest

from sglang_kvshare.config import KVShareArgs
from sglang_kvshare.segments import AnnotationError, Segment, Span, WireSpec, parse_annotation, tokenize_segments
from sglang_kvshare.segments.sources import REFERENCE_AGENT, SourceRecord, SourceRegistry


def _ann(**kw):
    base = {
        "workflow": "wf",
        "agent": "critic",
        "segments": [{"text": "sys", "shared": False}, {"text": "Q", "shared": True, "slot": "q"}],
    }
    base.update(kw)
    return base


def test_parse_defaults_method_and_keeps_order():
    ann = parse_annotation(_ann(), "fullshared")
    assert ann.method == "fullshared"
    assert [s.slot for s in ann.segments] == [None, "q"]


@pytest.mark.parametrize(
    "raw,message",
    [
        ([], "must be an object"),
        (_ann(method="nope"), "unknown kvshare method"),
        (_ann(workflow=""), "kvshare.workflow"),
        (_ann(segments=[{"text": "x", "shared": True}]), "no slot"),
        (_ann(segments=[{"text": "x", "shared": False, "slot": "q"}]), "not shared"),
        (
            _ann(segments=[{"text": "a", "shared": True, "slot": "q"}, {"text": "b", "shared": True, "slot": "q"}]),
            "appears twice",
        ),
        (_ann(segments=[{"text": None}]), "must be a string"),
        (_ann(extra=1), "unknown keys"),
        (_ann(sources={"zz": "solver"}), "no shared segment"),
        (_ann(recompute_ratio=1.5), "recompute_ratio"),
        (_ann(kv_views="off"), "kv_views must be true or false"),
        (_ann(leaves="always"), "leaves must be true or false"),
        (_ann(recompute_head=-1), "recompute_head must be an integer >= 0"),
        (_ann(recompute_head=True), "recompute_head must be an integer >= 0"),
    ],
)
def test_bad_annotations_name_the_problem(raw, message):
    with pytest.raises(AnnotationError, match=message):
        parse_annotation(raw, "nonshared")


def test_tokenize_segments_is_per_segment_with_prefix_and_output_substitution():
    encode = lambda t: [ord(c) for c in t]  # noqa: E731
    segs = [Segment("ab", False), Segment("cd", True, "q"), Segment("e", False), Segment("xyz", True, "out:s")]
    sub = lambda slot, text: [7, 7] if slot == "out:s" and text == "xyz" else None  # noqa: E731
    p = tokenize_segments(segs, encode, prefix_ids=[1], slot_tokens=sub)
    assert p.input_ids == [1, 97, 98, 99, 100, 101, 7, 7]
    assert p.spans == [Span(0, 1), Span(1, 3), Span(3, 5, "q"), Span(5, 6), Span(6, 8, "out:s")]


def test_wire_spec_round_trip_and_namespace():
    w = WireSpec("wf", "a", "fullshared", (Span(0, 3), Span(3, 9, "q")), {"q": "b"}, 0.2)
    back = WireSpec.loads(w.dumps())
    assert back == w
    assert back.namespace != WireSpec("wf", "b", "fullshared", ()).namespace


def test_lr_cache_methods_share_one_namespace_per_workflow():
    ns = {WireSpec("wf", a, "prelr_shared", ()).namespace for a in ("solver", "critic")}
    assert len(ns) == 1
    assert ns != {WireSpec("wf2", "solver", "prelr_shared", ()).namespace}
    assert WireSpec("wf", "solver", "nonshared", ()).namespace not in ns


def test_source_registry_latest_by_agent_and_lru():
    reg = SourceRegistry(max_workflows=2)
    rec = lambda agent: SourceRecord(agent, "ns-" + agent, (1, 2, 3), 1, 3)  # noqa: E731
    reg.record("w1", "q", rec("a"))
    reg.record("w1", "q", rec("b"))
    assert reg.lookup("w1", "q").agent == "b"
    assert reg.lookup("w1", "q", agent="a").agent == "a"
    assert reg.lookup("w1", "q", exclude="b").agent == "a"
    reg.record("w2", "q", rec("a"))
    reg.record("w3", "q", rec("a"))
    assert not reg.has("w1", "q") and reg.has("w3", "q")


def test_sequences_give_any_range_and_stay_within_their_token_budget():
    reg = SourceRegistry(sequence_tokens=10)
    reg.record_sequence("w", "seq:1", SourceRecord("a", "ns-a", (5, 6, 7, 8, 9, 10), 0, 6))
    rec = reg.in_sequence("w", "seq:1", 2, 5)
    assert (rec.agent, rec.namespace, rec.token_ids, rec.start, rec.end) == ("a", "ns-a", (5, 6, 7, 8, 9), 2, 5)
    assert reg.in_sequence("w", "seq:1", 4, 99).end == 6  # cut where the sequence ends
    assert reg.in_sequence("w", "seq:1", 6, 9) is None and reg.in_sequence("other", "seq:1", 0, 2) is None
    reg.record_sequence("w", "seq:2", SourceRecord("b", "ns-b", (1, 2, 3, 4, 5), 0, 5))
    assert reg.in_sequence("w", "seq:1", 0, 2) is None and reg.in_sequence("w", "seq:2", 0, 2) is not None


def test_a_namespace_is_spent_once_later_agents_superseded_all_its_records():
    reg = SourceRegistry()
    rec = lambda agent: SourceRecord(agent, "ns-" + agent, (1, 2, 3), 1, 3)  # noqa: E731
    reg.record("w", "q", rec("a"))
    reg.record("w", "out:a", rec("a"))
    assert not reg.spent("ns-a") and not reg.spent("ns-unknown")
    reg.record("w", "q", rec("b"))
    assert not reg.spent("ns-a")  # its output is still the latest record of out:a
    reg.record("w", "out:a", rec("b"))
    assert reg.spent("ns-a") and not reg.spent("ns-b")
    reg.record("w", "q", SourceRecord(REFERENCE_AGENT, "ns-ref", (1, 2, 3), 1, 3))
    assert not reg.spent("ns-b") and not reg.spent("ns-ref")  # references supersede nothing
    reg.record("w", "q", rec("a"))  # a again: the latest of q once more
    assert not reg.spent("ns-a") and not reg.spent("ns-b")
    reg.record("w", "out:a", rec("a"))
    assert reg.spent("ns-b")


def test_cli_flags_come_from_the_dataclass():
    import argparse

    parser = argparse.ArgumentParser()
    KVShareArgs.add_cli_args(parser)
    ns = parser.parse_args(["--kvshare-method", "nonshared", "--kvshare-tau", "0.5"])
    args = KVShareArgs.from_cli_args(ns)
    assert args.method == "nonshared" and args.tau == 0.5 and args.rank == 32
    assert KVShareArgs.from_env.__func__  # round trip through the environment
    with pytest.raises(SystemExit):
        parser.parse_args(["--kvshare-method", "bogus"])


@pytest.mark.parametrize(
    "flag,value",
    [
        ("--kvshare-lp-stash-columns", "-1"),
        ("--kvshare-target-rho", "1.5"),
        ("--kvshare-num-anchors", "0"),
        ("--kvshare-recompute-head", "-1"),
    ],
)
def test_bad_flag_values_get_an_error_naming_the_flag(flag, value):
    import argparse

    parser = argparse.ArgumentParser()
    KVShareArgs.add_cli_args(parser)
    with pytest.raises(ValueError, match=flag):
        KVShareArgs.from_cli_args(parser.parse_args([flag, value]))
    assert KVShareArgs.from_cli_args(parser.parse_args(["--kvshare-lp-stash-columns", "0.5"])).lp_stash_columns == 0.5


def test_head_rows_count_from_where_the_contexts_diverge():
    # the source saw the slot (tokens 7 8 9) after "1 2 3 4 5"; the reader after "6 6 4 5"
    rec = SourceRecord("a", "ns-a", (1, 2, 3, 4, 5, 7, 8, 9), 5, 8)
    assert rec.head_rows(6, (6, 6, 4, 5, 7, 8, 9), 4) == 4  # "4 5" precede it alike: 6 - 2
    assert rec.head_rows(2, (6, 6, 4, 5, 7, 8, 9), 4) == 0  # the window lies in the common run
    assert rec.head_rows(6, (6, 6, 6, 6, 7, 8, 9), 4) == 6  # nothing alike before the slot
    assert rec.head_rows(0, (6, 6, 4, 5, 7, 8, 9), 4) == 0
    assert rec.head_rows(6, (1, 2, 3, 4, 5, 7, 8, 9), 5) == 0  # the same path from position 0
    assert rec.head_rows(6, (9, 2, 3, 4, 5, 7, 8, 9), 5) == 2  # only the first token differs
    assert rec.head_rows(6, (4, 5, 7, 8, 9), 2) == 4  # a shorter prefix: its start diverges


def test_sharing_starts_past_the_head_rows():
    """A correction method's chunk stops past a segment's head rows (the chunk computes them
    densely), counted from where the prompt and the source's path diverge; other methods and
    a zero window stop at the segment's start."""
    from sglang_kvshare.integration.state.request import ReqShareState
    from sglang_kvshare.methods import get_method

    registry = SourceRegistry()
    registry.record("wf", "q", SourceRecord("solver", "ns-s", (1, 2, 3, 4, 5, 7, 8, 9), 5, 8))
    tokens = (6, 6, 4, 5, 7, 8, 9, 0)  # "4 5" precede the slot alike
    spans = (Span(0, 4), Span(4, 7, "q"), Span(7, 8))

    def state(method: str, window: int) -> ReqShareState:
        spec = WireSpec(workflow="wf", agent="critic", method=method, spans=spans)
        return ReqShareState(spec=spec, method=get_method(method), prompt_len=len(tokens), head_window=window)

    assert state("kvcmas", 3).next_cut(registry, after=0, tokens=tokens) == 4 + 1  # 3 - 2 alike
    assert state("kvcmas", 6).next_cut(registry, after=0, tokens=tokens) == 7  # capped at the segment's end
    assert state("kvcmas", 0).next_cut(registry, after=0, tokens=tokens) == 4
    assert state("fullshared", 0).next_cut(registry, after=0, tokens=tokens) == 4
    st = state("kvcmas", 3)
    assert st.next_cut(registry, after=5, tokens=tokens) is None  # past where its sharing starts
    assert st.heads == {1: 1}
