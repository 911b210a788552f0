"""Segment construction and turn order of each topology, driven by an in-test echo ``send``.

The echo sender only records payloads and returns deterministic text; it exercises the runner, not
the server.
"""

import http.server
import json
import threading

import pytest

from benchmarks.scoring import score_output
from sglang_kvshare.workflows.roles import PLAIN, get_roles, lora_conversation_roles, with_lora_adapters
from sglang_kvshare.workflows.runner import run_task, run_workflow
from sglang_kvshare.workflows.topology import build_payload, build_schedule, build_segments
from sglang_kvshare.workflows.transport import ServerError, http_sender
from sglang_kvshare.workflows.task import Task

MMLU_TASK = Task("mmlu/1", "mmlu", "Question: 2+2?\nA) 3\nB) 4\nC) 5\nD) 6", "B", ("3", "4", "5", "6"))
A0, A1, A2, F = "knowledgeable_expert", "wiki_searcher", "critic", "final_refer"


class EchoServer:
    """Records each payload; answers ``<agent>#<n>`` (n counts the agent's turns), or ``final``
    for the final agent, with token counts derived from the segments."""

    def __init__(self, final="B"):
        self.payloads = []
        self.final = final
        self._count = {}

    def __call__(self, payload):
        self.payloads.append(payload)
        kv = payload["kvshare"]
        n = self._count.get(kv["agent"], 0)
        self._count[kv["agent"]] = n + 1
        text = self.final if kv["agent"] == F else f"<{kv['agent']}#{n}>"
        prompt_tokens = sum(len(s["text"].split()) for s in kv["segments"])
        reused = sum(len(s["text"].split()) for s in kv["segments"] if s["shared"])
        return {
            "text": text,
            "meta_info": {
                "completion_tokens": 2,
                "kvshare": {
                    "method": kv["method"],
                    "prompt_tokens": prompt_tokens,
                    "reused_tokens": reused,
                    "computed_tokens": prompt_tokens - reused,
                    "segments": [],
                },
            },
        }


def _slots(payload):
    return [s.get("slot") for s in payload["kvshare"]["segments"] if s["shared"]]


def _run(topology, **kw):
    echo = EchoServer()
    kw.setdefault("score_fn", score_output)
    record = run_task(MMLU_TASK, get_roles("mmlu"), topology, "kvcmas", echo, 16, **kw)
    return echo, record


def test_sequential_reads_all_earlier_outputs_in_order():
    echo, record = _run("sequential")
    assert [p["kvshare"]["agent"] for p in echo.payloads] == [A0, A1, A2, F]
    assert [_slots(p) for p in echo.payloads] == [
        ["q"],
        ["q", f"out:{A0}"],
        ["q", f"out:{A0}", f"out:{A1}"],
        ["q", f"out:{A0}", f"out:{A1}", f"out:{A2}"],
    ]
    assert record.turns[3].read_slots == [f"out:{A0}", f"out:{A1}", f"out:{A2}"]


def test_fan_in_task_agents_read_only_question():
    echo, _ = _run("fan_in")
    assert [_slots(p) for p in echo.payloads] == [["q"], ["q"], ["q"], ["q", f"out:{A0}", f"out:{A1}", f"out:{A2}"]]


def test_fan_out_branches_read_only_the_root():
    echo, _ = _run("fan_out")
    assert [_slots(p) for p in echo.payloads] == [
        ["q"],
        ["q", f"out:{A0}"],
        ["q", f"out:{A0}"],
        ["q", f"out:{A0}", f"out:{A1}", f"out:{A2}"],
    ]


def test_loop_reads_latest_output_per_agent():
    echo, record = _run("loop", num_rounds=2)
    agents = [p["kvshare"]["agent"] for p in echo.payloads]
    assert agents == [A0, A1, A2, A0, A1, A2, F]
    assert [t.round for t in record.turns] == [0, 0, 0, 1, 1, 1, 1]

    def shared_texts(i):
        return [s["text"] for s in echo.payloads[i]["kvshare"]["segments"] if s["shared"]][1:]

    assert shared_texts(3) == [f"<{A0}#0>", f"<{A1}#0>", f"<{A2}#0>"]
    assert shared_texts(4) == [f"<{A1}#0>", f"<{A2}#0>", f"<{A0}#1>"]  # oldest first
    assert shared_texts(6) == [f"<{A0}#1>", f"<{A1}#1>", f"<{A2}#1>"]
    glue_before_own = echo.payloads[3]["kvshare"]["segments"][2]["text"]
    assert "You" in glue_before_own


def test_loop_with_one_round_equals_sequential():
    roles = ["a", "b", "c"]
    assert build_schedule("loop", roles, "f", num_rounds=1) == build_schedule("sequential", roles, "f")


def test_segment_layout_alternates_pf_and_ph():
    echo, _ = _run("sequential")
    segments = echo.payloads[3]["kvshare"]["segments"]
    shared = [s["shared"] for s in segments]
    assert shared == [False, True, False, True, False, True, False, True, False]
    role = get_roles("mmlu").final_role
    assert segments[0]["text"].startswith("<|im_start|>system\n" + role.system_prompt)
    assert segments[1]["text"] == MMLU_TASK.question
    assert segments[2]["text"] == role.glue("Knowledgeable Expert")
    assert segments[3]["text"] == f"<{A0}#0>"  # shared output passed byte-exact
    assert segments[-1]["text"].endswith("<|im_start|>assistant\n")
    assert all("slot" not in s for s in segments if not s["shared"])


def test_same_question_text_for_every_agent():
    echo, _ = _run("fan_in")
    q_texts = {p["kvshare"]["segments"][1]["text"] for p in echo.payloads}
    assert q_texts == {MMLU_TASK.question}


def test_plain_format_has_no_chat_markup():
    segments = build_segments(get_roles("gsm8k").task_roles[0], "Question: 1+1?", [], PLAIN)
    assert not any("<|im_" in s["text"] for s in segments)


def test_payload_fields_and_lora_path():
    roles = with_lora_adapters(get_roles("mmlu"), {A1: "critic-adapter"}, "You are an agent.")
    echo = EchoServer()
    run_task(MMLU_TASK, roles, "sequential", "cacheblend", echo, 32, workflow_id="wf-7")
    first, second = echo.payloads[0], echo.payloads[1]
    assert first["sampling_params"] == {"max_new_tokens": 32, "temperature": 0.0}
    assert first["kvshare"]["workflow"] == "wf-7"
    assert first["kvshare"]["method"] == "cacheblend"
    assert "lora_path" not in first
    assert second["lora_path"] == "critic-adapter"
    assert second["kvshare"]["segments"][0]["text"].count("You are an agent.") == 1


def test_final_output_scored_and_record_serialisable():
    echo, record = _run("sequential")
    assert record.final_output == "B" and record.score.correct
    wrong = run_task(MMLU_TASK, get_roles("mmlu"), "fan_in", "kvcmas", EchoServer(final="D"), 8, score_fn=score_output)
    assert not wrong.score.correct and wrong.score.predicted == "D"
    blob = json.loads(json.dumps(record.to_dict()))
    assert blob["turns"][0]["kvshare"]["method"] == "kvcmas"


def test_token_accounting():
    _, record = _run("sequential")
    for turn in record.turns:
        assert turn.trajectory_len == turn.prompt_tokens + 2
    assert record.total_prompt_tokens == sum(t.prompt_tokens for t in record.turns)
    assert record.total_reused_tokens + record.total_computed_tokens == record.total_prompt_tokens


def test_empty_output_is_left_out():
    class SilentFirst(EchoServer):
        def __call__(self, payload):
            reply = super().__call__(payload)
            if payload["kvshare"]["agent"] == A0:
                reply["text"] = ""
            return reply

    echo = SilentFirst()
    record = run_task(MMLU_TASK, get_roles("mmlu"), "sequential", "kvcmas", echo, 8)
    assert _slots(echo.payloads[3]) == ["q", f"out:{A1}", f"out:{A2}"]
    assert record.turns[3].read_slots == [f"out:{A1}", f"out:{A2}"]


def test_duplicate_slot_rejected():
    role = get_roles("mmlu").task_roles[0]
    with pytest.raises(ValueError, match="appears twice"):
        build_segments(role, "q", [("x", "X", "one"), ("x", "X", "two")])


def test_role_dataset_mismatch_and_unknown_topology():
    with pytest.raises(ValueError):
        run_task(MMLU_TASK, get_roles("gsm8k"), "sequential", "kvcmas", EchoServer(), 8)
    with pytest.raises(ValueError, match="unknown topology"):
        run_task(MMLU_TASK, get_roles("mmlu"), "star", "kvcmas", EchoServer(), 8)


def test_run_workflow_one_record_per_task_with_distinct_workflows():
    tasks = [MMLU_TASK, Task("mmlu/2", "mmlu", "Question: x\nA) 1\nB) 2", "A", ("1", "2"))]
    echo = EchoServer()
    records = run_workflow(tasks, get_roles("mmlu"), "fan_out", "kvcmas", echo, 8, score_fn=score_output)
    assert [r.task_id for r in records] == ["mmlu/1", "mmlu/2"]
    assert [r.score.correct for r in records] == [True, False]
    assert len({p["kvshare"]["workflow"] for p in echo.payloads}) == 2


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path != "/generate" or "kvshare" not in body:
            status, reply = 404, {"detail": "no route"}
        elif body["kvshare"]["method"] == "bogus":
            status, reply = 400, {"error": {"message": "unknown method 'bogus'"}}
        else:
            status, reply = 200, {"text": "ok", "meta_info": {"kvshare": {}}}
        data = json.dumps(reply).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def local_server():
    server = http.server.HTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


def test_http_sender_posts_and_raises_server_message(local_server):
    send = http_sender(local_server, timeout=5)
    ok = {"sampling_params": {}, "kvshare": {"method": "kvcmas"}}
    assert send(ok)["text"] == "ok"
    with pytest.raises(ServerError, match="HTTP 400: unknown method 'bogus'"):
        send({"sampling_params": {}, "kvshare": {"method": "bogus"}})


def test_lora_conversation_is_one_growing_prefix():
    """Each agent's prompt extends the previous agent's prompt and output (PReCache's setting)."""
    roles = lora_conversation_roles()
    assert [r.lora_path for r in roles.roles] == ["solver", "critic", "final"]
    outputs = {"solver": "S says 4.", "critic": "C agrees."}
    texts = []
    for i, role in enumerate(roles.roles):
        read = [(r.name, r.title, outputs[r.name]) for r in roles.roles[:i]]
        texts.append("".join(s["text"] for s in build_segments(role, "What is 2+2?", read)))
    for i in range(1, len(texts)):
        prev = roles.roles[i - 1]
        assert texts[i].startswith(texts[i - 1] + outputs[prev.name]), i


def test_without_score_fn_the_record_is_unscored():
    _, record = _run("fan_in", score_fn=None)
    assert record.score is None and record.final_output == "B"


def test_a_method_variant_label_becomes_annotation_keys():
    role = get_roles("mmlu").final_role
    segs = [{"text": "hi"}]
    assert build_payload(role, segs, "wf", "kvcmas+rows64", 4)["kvshare"] | {"segments": None} == {
        "workflow": "wf",
        "agent": role.name,
        "method": "kvcmas",
        "segments": None,
        "fallback": "rows",
        "fallback_block": 64,
    }
    assert build_payload(role, segs, "wf", "kvcmas+rows", 4)["kvshare"]["fallback"] == "rows"
    assert "fallback_block" not in build_payload(role, segs, "wf", "kvcmas+rows", 4)["kvshare"]
    assert build_payload(role, segs, "wf", "kvcmas+dense", 4)["kvshare"]["fallback"] == "dense"
    assert "fallback" not in build_payload(role, segs, "wf", "kvcmas", 4)["kvshare"]
    assert build_payload(role, segs, "wf", "fullshared+copy", 4)["kvshare"]["kv_views"] is False
    assert build_payload(role, segs, "wf", "kvcmas+leaf", 4)["kvshare"]["leaves"] is True
    assert "leaves" not in build_payload(role, segs, "wf", "kvcmas", 4)["kvshare"]
    both = build_payload(role, segs, "wf", "kvcmas+dense+rho0.5", 4)["kvshare"]
    assert (both["fallback"], both["target_rho"]) == ("dense", 0.5)
    for bad in ("kvcmas+rowsx", "kvcmas+partial", "nosuch+rows", "kvcmas+rho", "kvcmas+rhox", "kvcmas+leaves"):
        with pytest.raises(KeyError):
            build_payload(role, segs, "wf", bad, 4)
