"""Repeated token spans at any offset (``segments.token_index``): runs, sources, slot names, limits."""

import random

import pytest

from sglang_kvshare.segments.labels import merge_short, prompt_labels
from sglang_kvshare.segments.token_index import Entry, TokenIndex, seed_len

rng = random.Random(0)


def toks(n):
    return [rng.randrange(1000, 100000) for _ in range(n)]


REPORT, ANSWER, OTHER = toks(600), toks(120), toks(300)


def index(min_tokens=32, scope_tokens=1 << 20, total_tokens=1 << 22, max_scopes=16):
    return TokenIndex(min_tokens, scope_tokens, total_tokens, max_scopes)


def add_turn(ix, scope, agent, prompt, messages, output=()):
    """Index a request as the server does: its prompt (labelled), then its output."""
    key = ix.next_key(scope)
    runs = ix.find(scope, prompt)
    ix.add(scope, Entry(key, agent, "prompt", 0, prompt, prompt_labels(len(prompt), runs, agent, messages)))
    if output:
        ix.add(scope, Entry(key, agent, "output", len(prompt), list(output), [(0, len(output), f"out:{agent}")]))
    return key, runs


def test_seed_length_guarantees_every_run_of_min_tokens_holds_a_sampled_seed():
    for m in (1, 2, 5, 31, 32, 64, 500):
        k = seed_len(m)
        assert 1 <= k <= 16 and 2 * k - 1 <= m


def test_a_span_inside_a_templated_message_is_found_at_another_offset():
    ix = index()
    sys_a, task_a = toks(40), toks(25)
    prompt = sys_a + task_a + REPORT
    key, runs = add_turn(ix, "wf", "analyst", prompt, [0] * 40 + [1] * 625, ANSWER)
    assert runs == []
    # the reviewer's single user message embeds the report and the analyst's answer in a template
    later = toks(50) + toks(13) + REPORT + toks(7) + ANSWER + toks(9)
    found = ix.find("wf", later)
    assert [(r.slot, r.start, r.end, r.source, r.source_kind, r.src_start, r.src_end) for r in found] == [
        ("ctx:analyst:1", 63, 663, key, "prompt", 65, 665),
        ("out:analyst", 670, 790, key, "output", len(prompt), len(prompt) + 120),
    ]
    assert found[1].record() == {
        "slot": "out:analyst",
        "source_agent": "analyst",
        "source_kind": "output",
        "here": [670, 790],
        "there": [665, 785],
        "tokens": 120,
    }


def test_a_short_answer_is_found_where_it_follows_its_prompt():
    """An output extends its prompt's entry: a later prompt that repeats the prompt's end and the
    answer after it (a message history) gets one run through both, cut at the label change."""
    ix = index(min_tokens=64)
    prompt, answer = toks(20) + REPORT[:200], toks(24)
    key, _ = add_turn(ix, "wf", "solver", prompt, [0] * 20 + [1] * 200, answer)
    later = toks(30) + REPORT[:200] + answer + toks(10)
    found = ix.find("wf", later)
    assert [(r.slot, r.source_kind, r.start, r.end, r.src_start, r.src_end) for r in found] == [
        ("ctx:solver:1", "prompt", 30, 230, 20, 220),
        ("out:solver", "output", 230, 254, 220, 244),
    ]
    assert len(ix.scopes["wf"].entries) == 1 and ix.scopes["wf"].tokens == 244


def test_a_partial_quote_of_an_earlier_answer_is_found_and_short_runs_are_not():
    ix = index(min_tokens=32)
    key, _ = add_turn(ix, "wf", "solver", toks(80), [0] * 80, ANSWER)
    quote = toks(10) + ANSWER[30:75] + toks(10) + ANSWER[80:100] + toks(5)
    found = ix.find("wf", quote)
    assert [(r.slot, r.start, r.end, r.src_start) for r in found] == [("out:solver", 10, 55, 80 + 30)]


def test_the_most_recent_longest_source_wins_and_labels_travel_with_the_tokens():
    ix = index()
    key1, _ = add_turn(ix, "wf", "analyst", toks(30) + REPORT, [0] * 30 + [1] * 600, ANSWER)
    p2 = toks(30) + REPORT + toks(5) + ANSWER
    key2, runs2 = add_turn(ix, "wf", "reviewer", p2, [0] * 30 + [1] * 725, OTHER[:100])
    assert [r.source for r in runs2] == [key1, key1]
    # the editor's prompt repeats the reviewer's prompt run (report + template + answer): one
    # source (the chained one), cut where the labels change, named by where the text first appeared
    p3 = toks(20) + REPORT + p2[630:635] + ANSWER + OTHER[:100]
    found = ix.find("wf", p3)
    # (the 5 template tokens between, labelled ctx:reviewer:1, are shorter than a seed: they join
    # the part before them)
    assert [(r.slot, r.source, r.source_kind, r.start, r.end, r.src_start) for r in found] == [
        ("ctx:analyst:1", key2, "prompt", 20, 625, 30),
        ("out:analyst", key2, "prompt", 625, 745, 635),
        ("out:reviewer", key2, "output", 745, 845, 755),
    ]


def test_reordered_chunks_are_each_found_and_named_uniquely():
    ix = index()
    chunks = [toks(100) for _ in range(4)]
    add_turn(ix, "rag", "retriever", toks(20) + sum(chunks, []), [0] * 20 + [1] * 400)
    found = ix.find("rag", toks(15) + chunks[2] + chunks[0] + chunks[3])
    assert [(r.slot, r.start, r.src_start) for r in found] == [
        ("ctx:retriever:1", 15, 220),
        ("ctx:retriever:1#2", 115, 20),
        ("ctx:retriever:1#3", 215, 320),
    ]


def test_nothing_is_found_across_scopes():
    ix = index()
    add_turn(ix, "a", "x", toks(10) + REPORT, [0] * 610)
    assert ix.find("b", toks(10) + REPORT) == [] and len(ix.find("a", REPORT)) == 1


def test_limits_per_scope_and_in_total_hold_oldest_forgotten_first():
    ix = index(min_tokens=32, scope_tokens=1000, total_tokens=2500, max_scopes=3)
    first = toks(400)
    add_turn(ix, "a", "x", first, [0] * 400)
    for _ in range(4):
        add_turn(ix, "a", "x", toks(400), [0] * 400)
        assert ix.scopes["a"].tokens <= 1000
    assert ix.find("a", first) == []  # the oldest went first
    for name in "bcd":
        for _ in range(3):
            add_turn(ix, name, "x", toks(300), [0] * 300)
            assert ix.tokens <= 2500 and sum(s.tokens for s in ix.scopes.values()) == ix.tokens
    info = ix.info()
    assert info["scopes"] <= 3 and info["tokens"] <= 2500 and info["forgotten_entries"] > 0
    assert info["bytes"] > 0 and info["limit_scope_tokens"] == 1000
    # an entry larger than a limit is not indexed at all
    assert not ix.add("e", Entry("seq:1", "x", "prompt", 0, toks(1001), [(0, 1001, "ctx:x:0")]))
    # forgotten entries leave no seeds behind
    live = {n for s in ix.scopes.values() for n in s.entries}
    assert all(n in live for s in ix.scopes.values() for hits in s.seeds.values() for n, _ in hits)


def test_short_label_parts_join_a_neighbour():
    assert merge_short([(0, 3, "a"), (3, 40, "b"), (40, 45, "c"), (45, 90, "d"), (90, 92, "e")], 16) == [
        (0, 45, "b"),
        (45, 92, "d"),
    ]
    assert merge_short([(0, 5, "a"), (5, 9, "b")], 16) == [(0, 9, "a")]
    assert merge_short([(0, 50, "a")], 16) == [(0, 50, "a")]


def test_prompt_labels_cover_the_prompt():
    ix = index()
    key, _ = add_turn(ix, "wf", "a", REPORT, [0] * 600)
    prompt = toks(10) + REPORT[:200] + toks(40)
    runs = ix.find("wf", prompt)
    labels = prompt_labels(len(prompt), runs, "b", [0] * 5 + [1] * 245)
    assert labels == [(0, 5, "ctx:b:0"), (5, 10, "ctx:b:1"), (10, 210, "ctx:a:0"), (210, 250, "ctx:b:1")]


@pytest.mark.parametrize("n", [0, 5])
def test_prompts_shorter_than_a_seed_find_nothing(n):
    ix = index()
    add_turn(ix, "wf", "a", REPORT, [0] * 600)
    assert ix.find("wf", REPORT[:n]) == []


def test_common_run_equals_a_token_by_token_count():
    from array import array

    from sglang_kvshare.segments.token_index import common_run

    r = random.Random(1)
    for _ in range(500):
        a = [r.randrange(3) for _ in range(r.randrange(0, 300))]
        b = list(a) if r.random() < 0.5 else [r.randrange(3) for _ in range(r.randrange(0, 300))]
        if b and r.random() < 0.5:
            b[r.randrange(len(b))] = 9
        i, j = r.randrange(0, len(a) + 1), r.randrange(0, len(b) + 1)
        n = 0
        while i + n < len(a) and j + n < len(b) and a[i + n] == b[j + n]:
            n += 1
        assert common_run(array("i", a), i, array("i", b), j) == n
