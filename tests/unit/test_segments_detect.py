"""Automatic shared-span detection: scopes, agents, detected pieces, token alignment."""

import pytest

from sglang_kvshare.segments import AnnotationError
from sglang_kvshare.segments.detect import (
    Piece,
    ScopeMemory,
    agent_of,
    method_of,
    scope_of,
    token_spans,
)
from sglang_kvshare.segments.spec import Span


def hdr(**kw):
    return [(k.replace("_", "-").encode(), v.encode()) for k, v in kw.items()]


def words(text):
    return len(text.split())


CONTEXT = " ".join(f"w{i}" for i in range(80))
ANSWER = "The answer is forty-two, because the context says so plainly."


def test_scope_is_the_header_else_the_api_key_else_none():
    assert scope_of(hdr(x_kvshare_workflow="run-1", authorization="Bearer k"), False) == ("run-1", "header")
    wf, how = scope_of(hdr(Authorization="Bearer secret-key"), False)
    assert how == "api_key" and "secret" not in wf
    assert wf != scope_of(hdr(authorization="Bearer other-key"), False)[0]
    assert scope_of(hdr(), False) is None
    assert scope_of(hdr(), True) == ("server", "server")


@pytest.mark.parametrize("value", ["", "x" * 300, "caf\u00e9", "a\tb"])
def test_a_malformed_workflow_header_is_refused_by_name(value):
    with pytest.raises(AnnotationError, match="X-KVShare-Workflow"):
        scope_of([(b"x-kvshare-workflow", value.encode("utf-8"))], False)


def test_method_header_overrides_and_opts_out():
    names = ["kvcmas", "fullshared"]
    assert method_of(hdr(), "kvcmas", names) == "kvcmas"
    assert method_of(hdr(), None, names) is None
    assert method_of(hdr(x_kvshare_method="fullshared"), None, names) == "fullshared"
    assert method_of(hdr(x_kvshare_method="none"), "kvcmas", names) is None
    with pytest.raises(AnnotationError, match="X-KVShare-Method"):
        method_of(hdr(x_kvshare_method="bogus"), "kvcmas", names)


def test_agent_identity():
    sys_a = {"role": "system", "content": "You are the solver."}
    sys_b = {"role": "system", "content": "You are the critic."}
    a, how = agent_of([sys_a, {"role": "user", "content": "q"}], None)
    assert how == "system_prompt" and a == agent_of([sys_a], None)[0] != agent_of([sys_b], None)[0]
    assert agent_of([dict(sys_a, name="solver")], "u") == ("solver", "name")
    assert agent_of([sys_a], "alice") == ("alice", "user")
    assert agent_of([{"role": "user", "content": "q"}], None) == ("anonymous", "none")


def test_long_contents_become_slots_and_are_found_again_at_another_position():
    mem = ScopeMemory()
    first = mem.detect("solver", ["You are the solver.", CONTEXT], words, 64)
    assert first == [Piece("ctx:solver:1", CONTEXT, 1, "context", None)]
    later = mem.detect("critic", ["You are a critic with a longer prompt.", "intro", CONTEXT], words, 64)
    assert later == [Piece("ctx:solver:1", CONTEXT, 2, "context", "solver")]
    # short contents are never slots
    assert mem.detect("critic", ["short text"], words, 64) == []


def test_earlier_responses_are_found_whole_or_quoted():
    mem = ScopeMemory()
    mem.add_response("solver", ANSWER)
    assert mem.detect("critic", ["sys", ANSWER], words, 64) == [Piece("out:solver", ANSWER, 1, "output", "solver")]
    quoted = f"Review this answer:\n{ANSWER}\nBe brief."
    assert mem.detect("critic", ["sys", quoted], words, 64) == [Piece("out:solver", ANSWER, 1, "output", "solver")]
    # a response too short to search for inside text is found only as a whole message
    mem.add_response("judge", "OK")
    assert mem.detect("x", ["sys", "OK fine"], words, 64) == []
    assert mem.detect("x", ["sys", "OK"], words, 64)[0].slot == "out:judge"


def test_a_slot_appears_once_per_prompt():
    mem = ScopeMemory()
    mem.detect("solver", [CONTEXT], words, 64)
    pieces = mem.detect("critic", [CONTEXT, CONTEXT], words, 64)
    assert [p.slot for p in pieces] == ["ctx:solver:0"]


def test_generate_text_paragraphs_and_quoted_responses():
    mem = ScopeMemory()
    text = f"Instructions.\n\n{CONTEXT}\n\nQuestion?"
    assert [p.text for p in mem.detect_text("a", text, words, 64)] == [CONTEXT]
    mem.add_response("a", ANSWER + "\n\nSecond paragraph of the answer.")
    later = mem.detect_text("b", f"Other.\n\n{CONTEXT}\n\nAnswer was: {ANSWER}\n\nSecond paragraph of the answer.", words, 64)
    assert [(p.slot, p.kind) for p in later] == [("ctx:a:1", "context"), ("out:a", "output")]


def test_token_spans_are_the_stock_tokens_wholly_inside_each_piece():
    text = "sys: abc\n\nhello world, bye"
    # a tokenisation whose third token straddles the first piece's start
    offsets = [(0, 3), (3, 5), (5, 7), (7, 8), (8, 10), (10, 15), (15, 21), (21, 22), (22, 26)]
    pieces = [Piece("p1", "bc\n\nhello", 0, "context", None), Piece("p2", ", bye", 0, "output", "a"),
              Piece("gone", "not in the text", 0, "output", "a"), Piece("tiny", "y", 0, "output", "b")]
    kept, dropped, spans = token_spans(pieces, text, offsets, shift=1)
    assert [p.slot for p in kept] == ["p1", "p2"] and [p.slot for p in dropped] == ["gone", "tiny"]
    assert spans == [Span(0, 1), Span(1, 4), Span(4, 7, "p1"), Span(7, 8), Span(8, 10, "p2")]
    # spans cover the prompt without gaps
    assert all(a.end == b.start for a, b in zip(spans, spans[1:])) and spans[-1].end == 1 + len(offsets)
