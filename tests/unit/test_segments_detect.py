"""Automatic shared-span detection: scopes, agents, detected pieces, token alignment."""

import pytest

from sglang_kvshare.segments import AnnotationError
from sglang_kvshare.segments.detect import agent_of, message_starts, method_of, paragraph_starts, scope_of


def hdr(**kw):
    return [(k.replace("_", "-").encode(), v.encode()) for k, v in kw.items()]


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


def test_message_and_paragraph_starts():
    text = "<s>sys: A<e><s>user: B then A<e>"
    assert message_starts(text, ["A", "B then A", "missing"]) == [8, 21]
    assert paragraph_starts("one\ntwo\n\n  three\n\n\nfour") == [0, 11, 19]
