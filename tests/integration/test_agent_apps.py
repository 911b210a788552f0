"""Unmodified agent apps: automatic shared-span detection on SGLang's own chat path.

The real ``langgraph`` + ``langchain-openai`` and ``autogen-agentchat`` + ``autogen-ext[openai]``
packages run ``examples/langgraph_agents.py`` and ``examples/autogen_team.py`` in their own venv
(``scripts/setup.sh``), against the shared tiny server (``--kvshare-auto`` off: the
``X-KVShare-Method`` header turns detection on per request, as a user would opt one app in).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import openai
import pytest
import requests

from tests.integration.server import agents_python
from tests.integration.workflow_helpers import grew, payload, scrape_metrics, segments

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = {"langgraph": "langgraph_agents.py", "autogen": "autogen_team.py"}


def run_example(app: str, server, *headers: str, workflows: int = 2, words: int = 200) -> list[dict]:
    cmd = [agents_python(), str(ROOT / "examples" / EXAMPLES[app]), "--base-url", server.url + "/v1",
           "--workflows", str(workflows), "--words", str(words), "--max-tokens", "12"]
    for h in headers:
        cmd += ["--header", h]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines()]


@pytest.mark.parametrize("app", sorted(EXAMPLES))
def test_an_unmodified_framework_app_shares_kv(tiny_server, app):
    """Later agents' report and earlier answers are detected (no annotation in the app) and their
    KV injected. (An answer's last token has no KV in its source: it was never fed back; and a
    random model's answer may re-tokenise differently from how it was generated.)"""
    before = scrape_metrics(tiny_server)
    runs = run_example(app, tiny_server, "X-KVShare-Method:fullshared")
    after = scrape_metrics(tiny_server)
    assert len(runs) == 2 and all(a["answer"] for r in runs for a in r["agents"])
    assert grew(before, after, "kvshare_requests_total", method="fullshared") == 6
    # per workflow: the report in all three agents; the first answer in two, the second in one
    assert grew(before, after, "kvshare_detected_spans_total", kind="context") == 6
    assert grew(before, after, "kvshare_detected_spans_total", kind="output") == 6
    sourced = grew(before, after, "kvshare_sourced_tokens_total", method="fullshared")
    injected = grew(before, after, "kvshare_injected_tokens_total", method="fullshared")
    assert sourced > 500 and injected >= 0.95 * sourced
    assert grew(before, after, "kvshare_sources_missing_total") == 0


@pytest.mark.parametrize("app", sorted(EXAMPLES))
def test_auto_nonshared_answers_equal_a_plain_servers(tiny_server, tiny_stock_server, app):
    """Detected spans cut SGLang's own token ids: under nonshared the greedy answers are stock's."""
    ours = run_example(app, tiny_server, "X-KVShare-Method:nonshared")
    plain = run_example(app, tiny_stock_server)
    assert [[a["answer"] for a in r["agents"]] for r in ours] == [[a["answer"] for a in r["agents"]] for r in plain]


def _chat(server, headers: dict, agent: str, messages: list, **kw):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0,
                           default_headers=headers)
    return client.chat.completions.create(model="default", max_tokens=4, temperature=0, messages=[
        {"role": "system", "content": f"You are the {agent}."}, *messages], **kw)


REPORT = " ".join(f"Depot {i} shipped {3 * i} crates of figs." for i in range(40))


def test_no_reuse_across_scopes(tiny_server):
    """The same report in another scope (header, or API key) is computed, never injected."""
    auto = {"X-KVShare-Method": "fullshared"}
    first = _chat(tiny_server, {**auto, "X-KVShare-Workflow": "scope-a"}, "solver", [{"role": "user", "content": REPORT}])
    assert first.model_extra["kvshare"]["auto"]["detected"][0]["source_agent"] is None
    same = _chat(tiny_server, {**auto, "X-KVShare-Workflow": "scope-a"}, "critic", [{"role": "user", "content": REPORT}])
    other = _chat(tiny_server, {**auto, "X-KVShare-Workflow": "scope-b"}, "critic", [{"role": "user", "content": REPORT}])
    assert same.model_extra["kvshare"]["injected_tokens"] > 100
    kv = other.model_extra["kvshare"]
    assert kv["injected_tokens"] == 0 and kv["auto"]["detected"][0]["source_agent"] is None
    # API keys are scopes too (hashed; the key never appears in the record)
    by_key = [_chat(tiny_server, auto, agent, [{"role": "user", "content": REPORT}], api_key=key).model_extra["kvshare"]
              for agent, key in (("solver", "key-one"), ("critic", "key-two"), ("final", "key-one"))]
    assert by_key[0]["auto"]["scope"] == "api_key" and "key-one" not in json.dumps(by_key)
    assert by_key[1]["injected_tokens"] == 0 and by_key[2]["injected_tokens"] > 100
    # without a scope nothing is detected: the request is SGLang's own
    assert "kvshare" not in _chat(tiny_server, auto, "solver", [{"role": "user", "content": REPORT}],
                                  api_key="").model_extra


def test_generate_text_reuses_paragraphs_and_quoted_answers(tiny_server):
    headers = {"X-KVShare-Method": "fullshared", "X-KVShare-Workflow": "gen-scope"}
    first = requests.post(tiny_server.url + "/generate", headers=headers, timeout=120, json={
        "text": f"Notes for the solver.\n\n{REPORT}\n\nWhich depot shipped most?",
        "sampling_params": {"max_new_tokens": 16, "temperature": 0}}).json()
    answer = first["text"]
    later = requests.post(tiny_server.url + "/generate", headers=headers, timeout=120, json={
        "text": f"Critic notes, longer than the solver's.\n\n{REPORT}\n\nThe solver said: {answer}\nIs it right?",
        "sampling_params": {"max_new_tokens": 4, "temperature": 0}}).json()["meta_info"]["kvshare"]
    kinds = {d["kind"]: d for d in later["auto"]["detected"]}
    assert kinds["context"]["source_agent"] == "anonymous" and kinds["output"]["slot"] == "out:anonymous"
    assert later["injected_tokens"] > 100


@pytest.mark.parametrize("headers, named", [
    ({"X-KVShare-Method": "fullshared", "X-KVShare-Workflow": "bad\tscope"}, "X-KVShare-Workflow"),
    ({"X-KVShare-Method": "fullshared", "X-KVShare-Workflow": "x" * 300}, "X-KVShare-Workflow"),
    ({"X-KVShare-Method": "no-such-method", "X-KVShare-Workflow": "ok"}, "X-KVShare-Method"),
])
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
    body = {"model": "default", "max_tokens": 8, "temperature": 0, "logprobs": True,
            "messages": [{"role": "system", "content": "You are the solver."}, {"role": "user", "content": REPORT}]}
    answers = []
    for server in (tiny_server, tiny_stock_server):
        chat = requests.post(server.url + "/v1/chat/completions", json=body, timeout=60,
                             headers={"X-KVShare-Workflow": "plain"}).json()
        gen = requests.post(server.url + "/generate", timeout=60, headers={"X-KVShare-Workflow": "plain"},
                            json={"text": REPORT, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}).json()
        answers.append((chat, gen))
    (ours_chat, ours_gen), (stock_chat, stock_gen) = answers
    # the same tokens, text and fields; log-probabilities to float rounding (the tiny server may
    # serve the prompt's start from its radix cache, which sums in another order: 1e-7 apart seen)
    ours_lp, stock_lp = (_pop_logprobs(chat) for chat in (ours_chat, stock_chat))
    assert ours_lp == pytest.approx(stock_lp, rel=1e-5, abs=1e-5)
    strip = ("id", "created")
    assert {k: v for k, v in ours_chat.items() if k not in strip} == {k: v for k, v in stock_chat.items() if k not in strip}
    assert ours_gen["output_ids"] == stock_gen["output_ids"] and ours_gen["text"] == stock_gen["text"]
    # (the tiny server runs with --enable-metrics, which adds SGLang's timing fields to meta_info)
    assert "kvshare" not in ours_gen["meta_info"] and set(stock_gen["meta_info"]) <= set(ours_gen["meta_info"])


def test_sources_missing_is_reported_counted_and_logged(tiny_server):
    """A later agent whose earlier turns this worker never served (behind a router without the
    routing header) says so in its record and the metrics, and the log names the header."""
    before = scrape_metrics(tiny_server)
    r = tiny_server.generate(payload("never-seen-here", "critic", "fullshared",
                                     segments("critic", {"solver": "The answer is 15 red apples."}), 2))
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["kvshare"]["sources_missing"] is True
    assert grew(before, scrape_metrics(tiny_server), "kvshare_sources_missing_total") == 1
    assert "X-KVShare-Workflow" in tiny_server.log_tail(200) and "never-seen-here" in tiny_server.log_tail(200)
