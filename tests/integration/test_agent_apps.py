"""Unmodified agent apps: automatic shared-span detection on SGLang's own chat path.

The real ``langgraph`` + ``langchain-openai``, ``autogen-agentchat`` + ``autogen-ext[openai]`` and
``crewai`` packages run the examples (a LangGraph graph, an AutoGen team, a CrewAI crew, a
LangChain ``ChatPromptTemplate`` chain and a RAG pair) in their own venv (``scripts/setup.sh``),
against the shared tiny server (``--kvshare-auto`` off: the ``X-KVShare-Method`` header turns
detection on per request, as a user would opt one app in).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import openai
import pytest
import requests

from sglang_kvshare.testing.server import agents_python
from sglang_kvshare.testing.workflows import grew, payload, scrape_metrics, segments

ROOT = Path(__file__).resolve().parents[2]
# app -> (the example and its flags, agents per workflow)
EXAMPLES = {
    "langgraph": (["langgraph_agents.py"], 3),
    "autogen": (["autogen_team.py"], 3),
    "crewai": (["crewai_crew.py"], 3),
    "chain": (["langchain_templates.py", "--app", "chain"], 3),
    "rag": (["langchain_templates.py", "--app", "rag"], 2),
}


def run_example(app: str, server, *headers: str, workflows: int = 2, words: int = 200) -> list[dict]:
    script, *flags = EXAMPLES[app][0]
    cmd = [
        agents_python(),
        str(ROOT / "examples" / script),
        *flags,
        "--base-url",
        server.url + "/v1",
        "--workflows",
        str(workflows),
        "--words",
        str(words),
        "--max-tokens",
        "12",
    ]
    for h in headers:
        cmd += ["--header", h]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines()]


@pytest.mark.parametrize("app", sorted(EXAMPLES))
def test_an_unmodified_framework_app_shares_kv(tiny_server, app):
    """Later agents' report (inside a templated message for crewai, chain and rag; chunks
    reordered for rag) and earlier answers are detected as repeated token runs (no annotation in
    the app) and their KV injected. (A random model's short answers are not runs of 64 tokens by
    themselves; they count where they sit inside one.)"""
    before = scrape_metrics(tiny_server)
    # (rag: 8 chunks of a longer document, so that each is a run of 64 tokens or more)
    runs = run_example(app, tiny_server, "X-KVShare-Method:fullshared", words=600 if app == "rag" else 200)
    after = scrape_metrics(tiny_server)
    agents = EXAMPLES[app][1]
    assert len(runs) == 2 and all(len(r["agents"]) == agents and a["answer"] for r in runs for a in r["agents"])
    assert grew(before, after, "kvshare_requests_total", method="fullshared") == 2 * agents
    prompt = grew(before, after, "kvshare_prompt_tokens_total", method="fullshared")
    detected = grew(before, after, "kvshare_detected_tokens_total", kind="prompt") + grew(
        before, after, "kvshare_detected_tokens_total", kind="output"
    )
    # the later agents' prompts are ~the first one's length; nearly all of each is detected
    assert detected >= 0.75 * prompt * (agents - 1) / agents
    assert grew(before, after, "kvshare_detected_spans_total", kind="prompt") >= 2 * (agents - 1)
    sourced = grew(before, after, "kvshare_sourced_tokens_total", method="fullshared")
    injected = grew(before, after, "kvshare_injected_tokens_total", method="fullshared")
    assert sourced >= 0.95 * detected and injected >= 0.95 * sourced
    assert grew(before, after, "kvshare_sources_missing_total") == 0


@pytest.mark.parametrize("app", sorted(EXAMPLES))
def test_auto_nonshared_answers_equal_a_plain_servers(tiny_server, tiny_stock_server, app):
    """Detected spans cut SGLang's own token ids: under nonshared the greedy answers are stock's."""
    ours = run_example(app, tiny_server, "X-KVShare-Method:nonshared")
    plain = run_example(app, tiny_stock_server)
    assert [[a["answer"] for a in r["agents"]] for r in ours] == [[a["answer"] for a in r["agents"]] for r in plain]


def _chat(server, headers: dict, agent: str, messages: list, **kw):
    client = openai.OpenAI(
        base_url=server.url + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0, default_headers=headers
    )
    return client.chat.completions.create(
        model="default",
        max_tokens=4,
        temperature=0,
        messages=[{"role": "system", "content": f"You are the {agent}."}, *messages],
        **kw,
    )


REPORT = " ".join(f"Depot {i} shipped {3 * i} crates of figs." for i in range(40))


def test_no_reuse_across_scopes(tiny_server):
    """The same report in another scope (header, or API key) is computed, never injected."""
    auto = {"X-KVShare-Method": "fullshared"}
    first = _chat(
        tiny_server, {**auto, "X-KVShare-Workflow": "scope-a"}, "solver", [{"role": "user", "content": REPORT}]
    )
    assert first.model_extra["kvshare"]["auto"]["detected"] == []
    same = _chat(
        tiny_server, {**auto, "X-KVShare-Workflow": "scope-a"}, "critic", [{"role": "user", "content": REPORT}]
    )
    other = _chat(
        tiny_server, {**auto, "X-KVShare-Workflow": "scope-b"}, "critic", [{"role": "user", "content": REPORT}]
    )
    assert same.model_extra["kvshare"]["injected_tokens"] > 100
    kv = other.model_extra["kvshare"]
    assert kv["injected_tokens"] == 0 and kv["auto"]["detected"] == []
    # API keys are scopes too (hashed; the key never appears in the record)
    by_key = [
        _chat(tiny_server, auto, agent, [{"role": "user", "content": REPORT}], api_key=key).model_extra["kvshare"]
        for agent, key in (("solver", "key-one"), ("critic", "key-two"), ("final", "key-one"))
    ]
    assert by_key[0]["auto"]["scope"] == "api_key" and "key-one" not in json.dumps(by_key)
    assert by_key[1]["injected_tokens"] == 0 and by_key[2]["injected_tokens"] > 100
    # without a scope nothing is detected: the request is SGLang's own
    assert (
        "kvshare"
        not in _chat(tiny_server, auto, "solver", [{"role": "user", "content": REPORT}], api_key="").model_extra
    )


def canonical_window(tok, ids: list[int], n: int) -> list[int]:
    """The first ``n`` of ``ids`` that re-tokenise to themselves once decoded (a random model's
    output often does not, a real model's nearly always does)."""
    for a in range(len(ids) - n):
        if tok.encode(tok.decode(ids[a : a + n]), add_special_tokens=False) == ids[a : a + n]:
            return ids[a : a + n]
    raise AssertionError("no canonical window in the output")


def test_spans_inside_templated_text_and_a_partial_quote_are_reused(tiny_server):
    """/generate text: the report inside another template, and part of an earlier answer quoted
    mid-sentence, are found at their offsets and read from their sources' ranges."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_server.model_path)
    headers = {"X-KVShare-Method": "fullshared", "X-KVShare-Workflow": "gen-scope"}
    first = requests.post(
        tiny_server.url + "/generate",
        headers=headers,
        timeout=120,
        json={
            "text": f"Notes for the solver: {REPORT} Which depot shipped most?",
            "sampling_params": {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True},
        },
    ).json()
    quote = tok.decode(canonical_window(tok, first["output_ids"], 72))
    later = requests.post(
        tiny_server.url + "/generate",
        headers=headers,
        timeout=120,
        json={
            "text": f"Critic, with a longer preamble than the solver's. Report: {REPORT} The solver wrote, in part: "
            f"'{quote}'. Is it right?",
            "sampling_params": {"max_new_tokens": 4, "temperature": 0},
        },
    ).json()["meta_info"]["kvshare"]
    runs = later["auto"]["detected"]
    assert [r["source_kind"] for r in runs] == ["prompt", "output"], runs
    report, answer = runs
    prompt_len = first["meta_info"]["prompt_tokens"]
    assert report["slot"] == "ctx:anonymous:0" and report["tokens"] >= len(tok.encode(REPORT)) - 4
    assert answer["slot"] == "out:anonymous" and answer["tokens"] >= 64
    assert prompt_len < answer["there"][0] and answer["there"][1] <= prompt_len + 400
    assert report["here"][0] > report["there"][0]  # found at another offset
    assert later["injected_tokens"] >= report["tokens"] + answer["tokens"] - 2
    # the index's sizes and limits are on /server_info
    info = requests.get(tiny_server.url + "/server_info", timeout=30).json()["kvshare_auto_index"]
    assert info["tokens"] >= prompt_len + 400 and info["bytes"] > 0
    assert info["largest_scope_tokens"] <= info["limit_scope_tokens"] and info["tokens"] <= info["limit_total_tokens"]


@pytest.mark.parametrize(
    "headers, named",
    [
        ({"X-KVShare-Method": "fullshared", "X-KVShare-Workflow": "bad\tscope"}, "X-KVShare-Workflow"),
        ({"X-KVShare-Method": "fullshared", "X-KVShare-Workflow": "x" * 300}, "X-KVShare-Workflow"),
        ({"X-KVShare-Method": "no-such-method", "X-KVShare-Workflow": "ok"}, "X-KVShare-Method"),
    ],
)
def test_bad_headers_get_400_naming_them(tiny_server, headers, named):
    body = {"model": "default", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    r = requests.post(tiny_server.url + "/v1/chat/completions", headers=headers, json=body, timeout=60)
    assert r.status_code == 400 and named in r.json()["error"]["message"]
    assert requests.post(tiny_server.url + "/v1/chat/completions", json=body, timeout=60).status_code == 200


def _pop_logprobs(chat: dict) -> list[float]:
    """Remove and return the ``logprob`` values of a chat completion's choices (their tokens,
    bytes and the rest stay for an exact comparison)."""
    values = []
    for choice in chat["choices"]:
        for entry in (choice.get("logprobs") or {}).get("content") or ():
            values.append(entry.pop("logprob"))
            for alt in entry.get("top_logprobs") or ():
                values.append(alt.pop("logprob"))
    assert values, chat
    return values


def test_auto_off_is_stock_on_plain_requests(tiny_server, tiny_stock_server):
    """Detection off (no X-KVShare-Method): plain requests, even with a scope header, are answered
    as stock SGLang answers them."""
    body = {
        "model": "default",
        "max_tokens": 8,
        "temperature": 0,
        "logprobs": True,
        "messages": [{"role": "system", "content": "You are the solver."}, {"role": "user", "content": REPORT}],
    }
    answers = []
    for server in (tiny_server, tiny_stock_server):
        chat = requests.post(
            server.url + "/v1/chat/completions", json=body, timeout=60, headers={"X-KVShare-Workflow": "plain"}
        ).json()
        gen = requests.post(
            server.url + "/generate",
            timeout=60,
            headers={"X-KVShare-Workflow": "plain"},
            json={"text": REPORT, "sampling_params": {"max_new_tokens": 8, "temperature": 0}},
        ).json()
        answers.append((chat, gen))
    (ours_chat, ours_gen), (stock_chat, stock_gen) = answers
    # the same tokens, text and fields; log-probabilities to float rounding (the tiny server may
    # serve the prompt's start from its radix cache, which sums in another order: 1e-7 apart seen)
    ours_lp, stock_lp = (_pop_logprobs(chat) for chat in (ours_chat, stock_chat))
    assert ours_lp == pytest.approx(stock_lp, rel=1e-5, abs=1e-5)
    strip = ("id", "created")
    assert {k: v for k, v in ours_chat.items() if k not in strip} == {
        k: v for k, v in stock_chat.items() if k not in strip
    }
    assert ours_gen["output_ids"] == stock_gen["output_ids"] and ours_gen["text"] == stock_gen["text"]
    # (the tiny server runs with --enable-metrics, which adds SGLang's timing fields to meta_info)
    assert "kvshare" not in ours_gen["meta_info"] and set(stock_gen["meta_info"]) <= set(ours_gen["meta_info"])


def test_sources_missing_is_reported_counted_and_logged(tiny_server):
    """A later agent whose earlier turns this worker never served (behind a router without the
    routing header) says so in its record and the metrics, and the log names the header."""
    before = scrape_metrics(tiny_server)
    r = tiny_server.generate(
        payload(
            "never-seen-here", "critic", "fullshared", segments("critic", {"solver": "The answer is 15 red apples."}), 2
        )
    )
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["kvshare"]["sources_missing"] is True
    assert grew(before, scrape_metrics(tiny_server), "kvshare_sources_missing_total") == 1
    assert "X-KVShare-Workflow" in tiny_server.log_tail(200) and "never-seen-here" in tiny_server.log_tail(200)
