"""SGLang frontend programs (``@sgl.function``) against a real server: examples/ logic."""

from __future__ import annotations

import pytest
import sglang as sgl

from examples import lora_agents
from examples.prompt_agents import QUESTION, agent_turn, run_workflow
from sglang_kvshare.frontend import (
    KVShareEndpoint,
    MarkupError,
    agent_output,
    agent_role,
    build_request,
    parse_marked,
    plain_text,
    shared,
)
from sglang_kvshare.testing.server import kvshare_server
from sglang_kvshare.workflows import CHATML, build_segments, get_roles


class RecordingEndpoint(KVShareEndpoint):
    """Keeps every annotated /generate body it sends."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.sent = []

    def _annotated(self, s, sampling_params):
        data = super()._annotated(s, sampling_params)
        self.sent.append(data)
        return data


def _shared_segments(kv):
    return [s for s in kv["segments"] if s["shared"]]


def test_prompt_agents_share_kv(tiny_server):
    roles = get_roles("mmlu").roles
    endpoint = RecordingEndpoint(tiny_server.url, method="fullshared", chat_template_name="chatml")
    results = run_workflow(endpoint, roles, max_tokens=6, ignore_eos=True)
    assert [r["agent"] for r in results] == [r.name for r in roles]

    # the frontend sends exactly the trajectory the workflow runner would build (ChatML layout)
    for i, (role, body) in enumerate(zip(roles, endpoint.sent)):
        reads = [(r["agent"], r["title"], r["output"]) for r in results[:i]]
        assert body["kvshare"]["segments"] == build_segments(role, QUESTION, reads, CHATML)
        assert body["kvshare"]["agent"] == role.name
        assert body["kvshare"]["workflow"] == endpoint.workflow
        assert body["kvshare"]["method"] == "fullshared"
        assert "lora_path" not in body and "text" not in body

    first = results[0]["kvshare"]
    assert [s["mode"] for s in _shared_segments(first)] == ["computed"]
    assert first["computed_tokens"] == first["prompt_tokens"]
    for i, r in enumerate(results[1:], start=1):
        kv = r["kvshare"]
        segs = _shared_segments(kv)
        earlier = [x["agent"] for x in results[:i]]
        assert [s["slot"] for s in segs] == ["q"] + [f"out:{a}" for a in earlier]
        assert all(s["mode"] == "injected" for s in segs), segs
        q = segs[0]
        assert q["injected_tokens"] == q["tokens"] and q["source_agent"] in earlier
        # an output's last token has no KV at its source yet: all but (at most) one are injected
        assert all(s["injected_tokens"] >= s["tokens"] - 1 > 0 for s in segs[1:]), segs
        assert kv["reused_tokens"] == kv["injected_tokens"] == sum(s["injected_tokens"] for s in segs)
        assert kv["computed_tokens"] == kv["prompt_tokens"] - kv["reused_tokens"]


def test_prompt_agents_nonshared_computes_everything(tiny_server):
    endpoint = KVShareEndpoint(tiny_server.url, method="nonshared", chat_template_name="chatml")
    results = run_workflow(endpoint, get_roles("mmlu").roles[:2], max_tokens=4, ignore_eos=True)
    for r in results:
        kv = r["kvshare"]
        assert kv["method"] == "nonshared"
        assert kv["computed_tokens"] == kv["prompt_tokens"] and kv["reused_tokens"] == 0
        assert all(s["mode"] == "computed" for s in kv["segments"])


def test_streamed_program_and_plain_program(tiny_server):
    roles = get_roles("mmlu").roles
    endpoint = KVShareEndpoint(tiny_server.url, method="fullshared", chat_template_name="chatml")
    endpoint.new_workflow()
    first = agent_turn.run(role=roles[0], question=QUESTION, earlier=[], max_tokens=4, backend=endpoint)
    assert first["answer"] is not None and not first.error()
    state = agent_turn.run(role=roles[1], question=QUESTION, earlier=[], max_tokens=4, backend=endpoint, stream=True)
    chunks = list(state.text_iter("answer"))
    assert chunks and not state.error()
    kv = state.get_meta_info("answer")["kvshare"]  # unwrapped from the streamed list form
    assert isinstance(kv, dict) and kv["agent"] == roles[1].name
    q = _shared_segments(kv)[0]
    assert q["mode"] == "injected" and q["injected_tokens"] == q["tokens"] > 0

    @sgl.function
    def plain(s):
        s += "Hello, world. " + sgl.gen("x", max_tokens=3, temperature=0)

    out = plain.run(backend=endpoint)
    assert out["x"] is not None and "kvshare" not in out.get_meta_info("x")


def test_markup_parsing_and_errors():
    text = (
        agent_role("a", lora_path="lo")
        + "sys "
        + shared("Q", "q")
        + " glue "
        + agent_output("b", "B")
        + shared("", "e")
    )
    header, segs = parse_marked(text)
    assert header.name == "a" and header.lora_path == "lo"
    assert segs == [
        {"text": "sys ", "shared": False},
        {"text": "Q", "shared": True, "slot": "q"},
        {"text": " glue ", "shared": False},
        {"text": "B", "shared": True, "slot": "out:b"},
    ]
    assert plain_text(text) == "sys Q glue B"
    body = build_request(text, {"max_new_tokens": 1}, workflow="w", method="fullshared")
    assert body["lora_path"] == "lo" and body["kvshare"]["workflow"] == "w"
    assert build_request("no markup", {}, workflow="w", method=None) is None
    with pytest.raises(MarkupError, match="declares no agent"):
        build_request(shared("Q", "q"), {}, workflow="w", method=None)
    with pytest.raises(MarkupError, match="one agent"):
        parse_marked(agent_role("a") + agent_role("b"))
    with pytest.raises(MarkupError, match="marker characters"):
        shared("bad \ue002 text", "q")
    with pytest.raises(MarkupError, match="unterminated"):
        parse_marked(shared("Q", "q")[:-1])


@pytest.mark.slow
def test_lora_agents_share_kv(tmp_path, smollm2_path):
    """examples/lora_agents.py: SmolLM2 with the three trained role adapters, one per agent."""
    server = kvshare_server(smollm2_path, tmp_path / "server.log", *lora_agents.LORA_FLAGS, timeout=600)
    try:
        with pytest.raises(lora_agents.LoRANotServed, match="ghost"):
            lora_agents.check_adapters(server.url, names=("solver", "ghost"))
        results = lora_agents.run_lora_workflow(server.url, method="fullshared", max_tokens=8)
    finally:
        server.stop()
    assert [r["lora_path"] for r in results] == ["solver", "critic", "final"]
    assert all(r["output"] for r in results)
    assert [s["mode"] for s in _shared_segments(results[0]["kvshare"])] == ["computed"]
    for i, r in enumerate(results[1:], start=1):
        segs = _shared_segments(r["kvshare"])
        assert [s["slot"] for s in segs] == ["q"] + [f"out:{x['agent']}" for x in results[:i]]
        assert all(s["mode"] == "injected" and s["injected_tokens"] > 0 for s in segs), segs
        assert segs[0]["injected_tokens"] == segs[0]["tokens"]


def test_lora_example_fails_clearly_without_adapters(tiny_server):
    with pytest.raises(lora_agents.LoRANotServed, match="--enable-lora"):
        lora_agents.check_adapters(tiny_server.url)
