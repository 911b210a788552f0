"""The real default model (SmolLM2-135M-Instruct) through the plugin and through stock SGLang."""

import json

import pytest

from sglang_kvshare.testing.server import kvshare_server, running, stock_server
from sglang_kvshare.testing.workflows import payload, run_workflow, segments

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def servers(tmp_path_factory, smollm2_path):
    d = tmp_path_factory.mktemp("smollm2")
    with running(
        lambda: kvshare_server(smollm2_path, d / "ours.log", "--tool-call-parser", "pythonic"),
        lambda: stock_server(smollm2_path, d / "stock.log", "--tool-call-parser", "pythonic"),
    ) as (ours, stock):
        yield ours, stock


def test_nonshared_is_token_identical_to_stock_sglang(servers, smollm2_path):
    from transformers import AutoTokenizer

    ours, stock = servers
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    for agent, outputs in (("solver", {}), ("critic", {"solver": "Box 5 holds 15 red apples."})):
        segs = segments(agent, outputs)
        r = ours.generate(payload(f"smol-{agent}", agent, "nonshared", segs, 24))
        assert r.status_code == 200, r.text
        ids = [t for s in segs for t in tok.encode(s["text"], add_special_tokens=False)]
        s = stock.generate({"input_ids": ids, "sampling_params": {"max_new_tokens": 24, "temperature": 0}})
        assert s.status_code == 200, s.text
        assert r.json()["output_ids"] == s.json()["output_ids"]
        assert r.json()["meta_info"]["kvshare"]["prompt_tokens"] == len(ids)


def test_the_answer_is_coherent_and_reuse_skips_the_question(servers):
    ours, _ = servers
    shared = run_workflow(ours, "smol-flow", "fullshared", max_new_tokens=16)
    assert "15" in shared[0]["text"] or "apple" in shared[0]["text"].lower()
    meta = shared[1]["meta_info"]["kvshare"]
    assert meta["segments"][1]["mode"] == "injected"
    assert meta["computed_tokens"] < meta["prompt_tokens"] // 4


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "count_crates",
            "description": "Count the crates of one fruit",
            "parameters": {
                "type": "object",
                "properties": {"fruit": {"type": "string", "enum": ["apples", "pears", "figs"]}},
                "required": ["fruit"],
            },
        },
    }
]
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CONTEXT = (
    "The warehouse in Lyon holds 12 crates of apples and 7 crates of pears; the one in Porto holds 3 crates of figs. "
) * 3
# what each chat feature adds to a request, and what its answer must show
FEATURES = {
    "tools": {
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "count_crates"}},
        "parallel_tool_calls": False,
        "max_tokens": 60,
    },
    "json_schema": {
        "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}},
        "max_tokens": 40,
    },
    "logprobs": {"logprobs": True, "top_logprobs": 2, "max_tokens": 6},
    "n_seed": {"n": 2, "seed": 7, "temperature": 0.9, "max_tokens": 6},
}


def _features_of(answer, feature):
    """What the feature made of an answer, comparable across servers and requests."""
    if feature == "tools":
        return [(c.function.name, c.function.arguments) for c in answer.choices[0].message.tool_calls or []]
    if feature == "json_schema":
        return json.loads(answer.choices[0].message.content)
    if feature == "logprobs":
        return [(t.token, round(t.logprob, 3), len(t.top_logprobs)) for t in answer.choices[0].logprobs.content]
    return [c.message.content for c in answer.choices]


@pytest.mark.parametrize("how", ["annotated", "auto"])
@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_a_shared_chat_keeps_sglangs_chat_features(servers, feature, how):
    """Tool calls, json_schema, logprobs, n and seed on a shared chat request (SGLang's own chat
    serving), annotated or detected automatically (headers only): the first agent's answer
    equals stock SGLang's (greedy), and the later agent, whose question is injected, still gets a
    parsed tool call, schema-valid JSON, logprobs, two choices."""
    import openai

    ours, stock = servers
    workflow = f"chat-{feature}-{how}"

    def ask(server, agent, share=False):
        headers = {"X-KVShare-Workflow": workflow, "X-KVShare-Method": "fullshared"} if share and how == "auto" else {}
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, default_headers=headers)
        kwargs = {"temperature": 0, **FEATURES[feature]}
        extra = (
            {"kvshare": {"workflow": workflow, "agent": agent, "method": "fullshared", "shared_messages": {"1": "q"}}}
            if share and how == "annotated"
            else {}
        )
        return client.chat.completions.create(
            model="default",
            extra_body=extra,
            **kwargs,
            messages=[
                {"role": "system", "content": f"You are the {agent} of a logistics team."},
                {"role": "user", "content": CONTEXT + "Which city has the figs?"},
            ],
        )

    plain = ask(stock, "solver")
    first = ask(ours, "solver", share=True)
    later = ask(ours, "critic", share=True)
    # n = 2: two requests of one agent; the record is the last one's, which may reuse the first's q
    allowed = ("computed", "injected") if feature == "n_seed" else ("computed",)
    first_shared = [s for s in first.model_extra["kvshare"]["segments"] if s["shared"]]
    assert all(s["mode"] in allowed for s in first_shared) and (first_shared or how == "auto")
    q = later.model_extra["kvshare"]["segments"][1]
    # detected: named by the agent that first sent it and its message index
    assert q["slot"] == ("q" if how == "annotated" else f"ctx:{first.model_extra['kvshare']['auto']['agent']}:1")
    assert q["mode"] == "injected" and q["injected_tokens"] == q["tokens"] > 60
    assert later.usage.prompt_tokens == later.model_extra["kvshare"]["prompt_tokens"]
    if feature != "n_seed":  # SGLang's sampling on the CPU does not repeat under a seed, stock or ours
        assert _features_of(first, feature) == _features_of(plain, feature)
    got = _features_of(later, feature)
    if feature == "tools":
        assert later.choices[0].finish_reason == "tool_calls" and got and got[0][0] == "count_crates"
    elif feature == "json_schema":
        assert isinstance(got["city"], str)
    elif feature == "logprobs":
        assert len(got) == 6 and all(k == 2 for _, _, k in got)
    else:
        assert len(got) == 2 and all(isinstance(c, str) for c in got)
