"""The plugin inside the real SGLang engine (tiny random-weight Llama on CPU)."""

from __future__ import annotations

import concurrent.futures as cf

import pytest
import torch

from sglang_kvshare.testing.workflows import (
    QUESTION,
    SYSTEM,
    flush_cache,
    grew,
    payload,
    private_tokens,
    run_workflow,
    scrape_metrics,
    segments,
    settle,
)


def test_nonshared_matches_stock_sglang(tiny_server, tiny_stock_server):
    for i, agent in enumerate(["solver", "critic"]):
        segs = segments(agent, {"solver": "The answer is 15 red apples."} if i else {})
        ours = tiny_server.generate(payload(f"stock-{i}", agent, "nonshared", segs, 12))
        assert ours.status_code == 200, ours.text
        meta = ours.json()["meta_info"]["kvshare"]
        # the same token ids, sent to stock SGLang without any annotation
        ids = ours.json()["meta_info"].get("input_ids")
        text = "".join(s["text"] for s in segs)
        stock = tiny_stock_server.generate(
            {"input_ids": _token_ids(tiny_server, segs), "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
        )
        assert stock.status_code == 200, stock.text
        assert ours.json()["output_ids"] == stock.json()["output_ids"]
        assert meta["computed_tokens"] == meta["prompt_tokens"] == stock.json()["meta_info"]["prompt_tokens"]
        assert ids is None and text


def _token_ids(server, segs) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(server.model_path)
    ids: list[int] = []
    for s in segs:
        ids += tok.encode(s["text"], add_special_tokens=False)
    return ids


def _load(server, workflow, agent, slot):
    from sglang_kvshare.integration.cache.radix import _safe  # same file naming as the server

    return torch.load(server.dump_dir / _safe(workflow) / _safe(agent) / f"{_safe(slot)}.pt")


def test_fullshared_is_exact_when_context_is_equal(tiny_server):
    # critic-b has exactly solver's private text: its injected question cache is exact
    system = SYSTEM["solver"]
    for method in ("nonshared", "fullshared"):
        wf = f"exact-{method}"
        first = tiny_server.generate(payload(wf, "solver", method, segments("solver", {}, system), 10))
        assert first.status_code == 200
        second = tiny_server.generate(payload(wf, "twin", method, segments("solver", {}, system), 10))
        assert second.status_code == 200, second.text
        if method == "nonshared":
            dense_tokens = second.json()["output_ids"]
        else:
            meta = second.json()["meta_info"]["kvshare"]
            assert [s["mode"] for s in meta["segments"]] == ["computed", "injected", "computed"]
            assert second.json()["output_ids"] == dense_tokens
    dense = _load(tiny_server, "exact-nonshared", "twin", "q")
    injected = _load(tiny_server, "exact-fullshared", "twin", "q")
    assert dense["start"] == injected["start"]
    torch.testing.assert_close(injected["k"], dense["k"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(injected["v"], dense["v"], atol=1e-5, rtol=1e-5)


def test_injection_at_a_different_position_realigns_keys(tiny_server):
    # the critic's system prompt is longer: its question sits at another position. Layer-0 K/V
    # depend on the token alone, so after the RoPE re-alignment they must equal dense exactly.
    for method in ("nonshared", "fullshared"):
        wf = f"shift-{method}"
        assert tiny_server.generate(payload(wf, "solver", method, segments("solver", {}), 4)).status_code == 200
        r = tiny_server.generate(payload(wf, "critic", method, segments("critic", {}), 4))
        assert r.status_code == 200, r.text
    dense = _load(tiny_server, "shift-nonshared", "critic", "q")
    injected = _load(tiny_server, "shift-fullshared", "critic", "q")
    source = _load(tiny_server, "shift-fullshared", "solver", "q")
    assert injected["start"] != source["start"]
    assert injected["meta"]["segments"][1]["mode"] == "injected"
    torch.testing.assert_close(injected["k"][0], dense["k"][0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(injected["v"][0], dense["v"][0], atol=1e-6, rtol=1e-6)
    # without the rotation the keys would be the source's, which differ
    assert (source["k"][0] - dense["k"][0]).abs().max() > 1e-2
    # deeper layers see another context: the cache is approximate there (fullshared's error)
    assert (injected["v"][1] - dense["v"][1]).abs().max() > 1e-4


def test_later_agents_compute_only_private_tokens(tiny_server):
    # other tests sharing this server may have filled the pool: an eviction during the workflow
    # would shrink what the tree is seen to gain, so start from an empty tree
    flush_cache(tiny_server)
    before = settle(tiny_server)["tree_tokens"]
    shared = run_workflow(tiny_server, "skip-fullshared", "fullshared")
    # every agent's request keeps KV of what it computed; what it read through a KV view (the
    # server's default) stays in the source's slots: the tree grows by each prompt less those
    # tokens (and at most by its output more)
    grown = settle(tiny_server)["tree_tokens"] - before
    owned = sum(
        out["meta_info"]["kvshare"]["prompt_tokens"] - out["meta_info"]["kvshare"]["view_tokens"] for out in shared
    )
    assert sum(out["meta_info"]["kvshare"]["view_tokens"] for out in shared) >= 600
    assert owned <= grown <= owned + sum(out["meta_info"]["completion_tokens"] for out in shared)
    dense = run_workflow(tiny_server, "skip-nonshared", "nonshared")
    q_tokens = shared[0]["meta_info"]["kvshare"]["segments"][1]["tokens"]
    assert q_tokens >= 300
    first = shared[0]["meta_info"]["kvshare"]
    assert first["computed_tokens"] == first["prompt_tokens"]
    for out in shared[1:]:
        meta = out["meta_info"]["kvshare"]
        ph = [s for s in meta["segments"] if s["shared"]]
        assert all(s["mode"] == "injected" for s in ph)
        # the question is injected whole; an output segment may miss its last token, whose KV
        # no engine holds after a length-limited decode (it was sampled, never fed back)
        assert ph[0]["injected_tokens"] == ph[0]["tokens"]
        assert all(s["tokens"] - s["injected_tokens"] <= 1 for s in ph[1:])
        missing = sum(s["tokens"] - s["injected_tokens"] for s in ph)
        assert meta["computed_tokens"] == private_tokens(meta) + missing
        assert meta["injected_tokens"] == meta["prompt_tokens"] - meta["computed_tokens"]
    for out in dense:
        meta = out["meta_info"]["kvshare"]
        assert meta["computed_tokens"] == meta["prompt_tokens"]
        assert all(s["mode"] == "computed" for s in meta["segments"])


BAD = [
    ({"method": "telepathy"}, "unknown kvshare method"),
    ({"segments": [{"text": "", "shared": False}]}, "text is empty"),
    ({"segments": [{"text": 42, "shared": False}]}, "text must be a string"),
    ({"segments": [{"text": "hi", "shared": True}]}, "no slot"),
    ({"segments": []}, "non-empty list"),
    ({"agent": ""}, "kvshare.agent"),
    ({"method": "cacheblend", "recompute_ratio": 1.5}, "recompute_ratio"),
]


@pytest.mark.parametrize("patch,message", BAD)
def test_bad_annotations_get_400_and_the_server_keeps_serving(tiny_server, patch, message):
    body = payload("bad", "solver", "fullshared", segments("solver", {}), 2)
    body["kvshare"].update(patch)
    r = tiny_server.generate(body)
    assert r.status_code == 400
    assert message in r.json()["error"]["message"]
    ok = tiny_server.generate(payload("bad-ok", "solver", "fullshared", segments("solver", {}), 2))
    assert ok.status_code == 200


def test_text_with_annotation_and_oversized_prompt_get_400(tiny_server):
    body = payload("bad2", "solver", "nonshared", segments("solver", {}), 2)
    body["text"] = "hello"
    r = tiny_server.generate(body)
    assert r.status_code == 400 and "do not also send 'text'" in r.json()["error"]["message"]
    huge = payload("bad2", "solver", "nonshared", segments("solver", {}, question=QUESTION * 12), 2)
    r = tiny_server.generate(huge)
    assert r.status_code == 400 and "context is" in r.json()["error"]["message"]
    assert tiny_server.generate(payload("bad2-ok", "solver", "nonshared", segments("solver", {}), 2)).status_code == 200


def test_concurrent_workflows_finish_with_correct_counts(tiny_server):
    with cf.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(run_workflow, tiny_server, f"conc-{i}", "fullshared") for i in range(4)]
        results = [f.result(timeout=600) for f in futures]
    for responses in results:
        assert (
            responses[0]["meta_info"]["kvshare"]["computed_tokens"]
            == responses[0]["meta_info"]["kvshare"]["prompt_tokens"]
        )
        for out in responses[1:]:
            meta = out["meta_info"]["kvshare"]
            missing = sum(s["tokens"] - s.get("injected_tokens", 0) for s in meta["segments"] if s["shared"])
            assert missing <= len(meta["segments"]) // 2 - 1  # at most the last token of each output
            assert meta["computed_tokens"] == private_tokens(meta) + missing


def test_openai_chat_marks_messages_shared(tiny_server):
    import requests

    def chat(agent, system, shared=None, **extra):
        body = {
            "model": "default",
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": QUESTION}],
            "max_tokens": 4,
            "temperature": 0,
            "kvshare": {
                "workflow": "chat-1",
                "agent": agent,
                "method": "fullshared",
                "shared_messages": shared if shared is not None else {"1": "q"},
            },
            **extra,
        }
        return requests.post(tiny_server.url + "/v1/chat/completions", json=body, timeout=300)

    first = chat("solver", SYSTEM["solver"])
    assert first.status_code == 200, first.text
    assert first.json()["object"] == "chat.completion"
    assert first.json()["kvshare"]["segments"][1]["mode"] == "computed"
    second = chat("critic", SYSTEM["critic"]).json()
    seg = second["kvshare"]["segments"][1]
    assert seg["shared"] and seg["slot"] == "q" and seg["mode"] == "injected"
    assert second["usage"]["prompt_tokens"] == second["kvshare"]["prompt_tokens"]
    assert isinstance(second["choices"][0]["message"]["content"], str)
    bad = chat("critic", SYSTEM["critic"], shared={"7": "q"})
    assert bad.status_code == 400 and "message 7" in bad.json()["error"]["message"]


def test_openai_client_streams_an_annotated_chat(tiny_server):
    """Agent frameworks stream: the official client, ``stream=True`` and ``extra_body``."""
    import openai

    client = openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="none")

    def chat(agent, stream, **extra):
        return client.chat.completions.create(
            model="default",
            max_tokens=6,
            temperature=0,
            stream=stream,
            messages=[{"role": "system", "content": SYSTEM[agent]}, {"role": "user", "content": QUESTION}],
            extra_body={
                "kvshare": {
                    "workflow": "chat-stream",
                    "agent": agent,
                    "method": "fullshared",
                    "shared_messages": {"1": "q"},
                },
                "ignore_eos": True,
            },
            **extra,
        )

    chat("solver", False)
    plain = chat("critic", False)
    chunks = list(chat("critic", True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content  # greedy: the same answer, streamed
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 6
    kv = last.model_extra["kvshare"]
    q = next(s for s in kv["segments"] if s.get("slot") == "q")
    assert q["mode"] == "injected" and q["injected_tokens"] == q["tokens"] > 0
    assert last.usage.prompt_tokens == kv["prompt_tokens"]
    # without include_usage the last chunk still carries the record, and no usage
    last = list(chat("critic", True))[-1]
    assert last.model_extra["kvshare"]["agent"] == "critic" and last.usage is None


def test_an_evicted_source_means_dense_prefill_not_an_error(tiny_server):
    first = tiny_server.generate(payload("evict-1", "solver", "fullshared", segments("solver", {}), 4))
    assert first.status_code == 200
    flush_cache(tiny_server)
    r = tiny_server.generate(
        payload("evict-1", "critic", "fullshared", segments("critic", {"solver": first.json()["text"]}), 4)
    )
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]["kvshare"]
    assert all(s["mode"] == "computed" for s in meta["segments"])
    assert meta["computed_tokens"] == meta["prompt_tokens"]


def test_help_lists_sglang_and_kvshare_flags():
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "sglang_kvshare.launch_server", "--help"], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    for flag in ("--model-path", "--attention-backend", "--kvshare-method", "--kvshare-tau", "--kvshare-dump-dir"):
        assert flag in out.stdout
    usage = out.stdout.split("\n\n")[0]
    assert "[--model-path MODEL_PATH]" in usage and "embedded SmolLM2-135M-Instruct" in out.stdout  # optional here


def test_streamed_agents_get_the_record_and_their_output_is_a_source(tiny_server):
    def stream(agent, outputs):
        return tiny_server.stream(payload("stream-1", agent, "fullshared", segments(agent, outputs), 6))

    first = stream("solver", {})
    assert isinstance(first[-1]["meta_info"]["kvshare"], dict)
    text = first[-1]["text"]
    second = stream("critic", {"solver": text})
    meta = second[-1]["meta_info"]["kvshare"]
    assert isinstance(meta, dict)
    out_seg = meta["segments"][3]
    assert out_seg["slot"] == "out:solver" and out_seg["mode"] == "injected"
    # the exact output tokens stand for the text: all but the never-fed last token are injected
    assert out_seg["tokens"] - out_seg["injected_tokens"] <= 1


def test_sharing_metrics_on_sglangs_metrics_endpoint(tiny_server):
    import requests

    text = requests.get(tiny_server.url + "/metrics", timeout=30).text
    assert "sglang:" in text  # SGLang's own metrics are there beside ours
    before = scrape_metrics(tiny_server)
    metas = [r["meta_info"]["kvshare"] for r in run_workflow(tiny_server, "metrics-1", "fullshared")]
    metas += [
        r["meta_info"]["kvshare"] for r in run_workflow(tiny_server, "metrics-2", "kvcmas", agents=("solver", "critic"))
    ]
    after = scrape_metrics(tiny_server)

    for method in ("fullshared", "kvcmas"):
        mine = [m for m in metas if m["method"] == method]
        assert grew(before, after, "kvshare_requests_total", method=method) == len(mine)
        for key in ("prompt_tokens", "reused_tokens", "computed_tokens", "injected_tokens"):
            assert grew(before, after, f"kvshare_{key}_total", method=method) == sum(m[key] for m in mine), key
    assert grew(before, after, "kvshare_reused_tokens_total", method="fullshared") > 0
    # the critic's kvcmas question segment was gated: one correction counted by its outcome and reason
    gated = [s for m in metas if m["method"] == "kvcmas" for s in m["segments"] if "gate" in s]
    assert gated
    for s in gated:
        outcome = "accepted" if s["gate"] == "accepted" else "rejected"
        assert grew(before, after, "kvshare_corrections_total", method="kvcmas", outcome=outcome, reason=s["gate"]) >= 1
    assert grew(before, after, "kvshare_correction_seconds_count", method="kvcmas") == len(
        [m for m in metas if m["method"] == "kvcmas"]
    )
    assert after[("kvshare_anchor_bytes", (("method", "kvcmas"),))] == metas[-1]["anchor_bytes"]


def test_streamed_annotated_requests_are_counted(tiny_server):
    """Frameworks stream: a streamed annotated chat and a streamed /generate are counted like
    answered ones, and every streamed /generate event carries the record."""
    import openai

    client = openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="none", max_retries=0)
    before = scrape_metrics(tiny_server)
    chunks = list(
        client.chat.completions.create(
            model="default",
            max_tokens=4,
            temperature=0,
            stream=True,
            messages=[{"role": "system", "content": SYSTEM["solver"]}, {"role": "user", "content": QUESTION}],
            extra_body={
                "kvshare": {
                    "workflow": "metrics-stream",
                    "agent": "solver",
                    "method": "nonshared",
                    "shared_messages": {"1": "q"},
                }
            },
        )
    )
    chat_kv = chunks[-1].model_extra["kvshare"]
    events = tiny_server.stream(payload("metrics-stream", "critic", "nonshared", segments("critic", {}), 4))
    records = [e["meta_info"]["kvshare"] for e in events]
    assert all(r["agent"] == "critic" for r in records)
    after = scrape_metrics(tiny_server)
    assert grew(before, after, "kvshare_requests_total", method="nonshared") == 2
    assert grew(before, after, "kvshare_prompt_tokens_total", method="nonshared") == (
        chat_kv["prompt_tokens"] + records[-1]["prompt_tokens"]
    )


def test_a_segment_cut_chunk_beside_a_long_prompt_keeps_the_scheduler_alive(tiny_server):
    """A later agent's chunk stops at its next segment and leaves chunk budget unused; a long
    plain prompt queued meanwhile would be chunked too, and SGLang tracks one unfinished chunked
    request (the scheduler asserted and died: found at 0.13 wf/s in the LoRA serving run). Both
    must be answered, and the server keep serving."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_server.model_path)
    system = " ".join(f"Rule {i}: check unit {i} twice." for i in range(100))  # ~1.1K private tokens
    notes = " ".join(f"Note {i}: the critic reads line {i}." for i in range(120))  # ~1.4K between segments
    long_text = " ".join(f"Line {i} of a long plain prompt." for i in range(280))
    # the long prompt does not fit the budget the cut chunk leaves of the 4096-token CPU chunk
    assert 4096 - len(tok(notes).input_ids) < len(tok(long_text).input_ids) < 3800
    for round_ in range(3):
        wf = f"cut-beside-long-{round_}"
        first = tiny_server.generate(payload(wf, "solver", "fullshared", segments("solver", {}), 6))
        assert first.status_code == 200, first.text
        segs = [
            {"text": f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n", "shared": False},
            {"text": QUESTION, "shared": True, "slot": "q"},
            {"text": f"\n{notes}\nsolver wrote: ", "shared": False},
            {"text": first.json()["text"], "shared": True, "slot": "out:solver"},
            {"text": "<|im_end|>\n<|im_start|>assistant\n", "shared": False},
        ]
        plain = {"text": long_text, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
        with cf.ThreadPoolExecutor(2) as pool:
            later = pool.submit(tiny_server.generate, payload(wf, "critic", "fullshared", segs, 6))
            other = pool.submit(tiny_server.generate, plain)
            later, other = later.result(timeout=300), other.result(timeout=300)
        assert later.status_code == 200, later.text
        assert other.status_code == 200, other.text
        meta = later.json()["meta_info"]["kvshare"]
        assert [s["mode"] for s in meta["segments"] if s["shared"]] == ["injected", "injected"]
    assert (
        tiny_server.generate(
            payload("cut-beside-long-ok", "solver", "nonshared", segments("solver", {}), 2)
        ).status_code
        == 200
    )


def test_plain_requests_never_enter_the_sharing_path(tiny_server):
    """Requests with no annotation and no header run plain forwards (SGLang's own layers, keys
    at their own positions); one annotated request makes its forwards shared."""
    import requests

    before = settle(tiny_server)["forwards"]
    text = "Plain traffic: " + QUESTION
    assert tiny_server.generate({"text": text, "sampling_params": {"max_new_tokens": 6, "temperature": 0}}).ok
    assert len(tiny_server.stream({"text": text + " Again.", "sampling_params": {"max_new_tokens": 6}})) >= 1
    chat = requests.post(
        tiny_server.url + "/v1/chat/completions",
        timeout=300,
        json={"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 6, "stream": True},
    )
    assert chat.status_code == 200 and b"[DONE]" in chat.content
    plain = settle(tiny_server)["forwards"]
    assert plain["shared"] == before["shared"], (before, plain)
    assert plain["plain"] >= before["plain"] + 3 * 6, (before, plain)  # a prefill and decodes each
    r = tiny_server.generate(payload("plain-then-shared", "solver", "fullshared", segments("solver", {}), 4))
    assert r.status_code == 200
    assert settle(tiny_server)["forwards"]["shared"] > plain["shared"]
