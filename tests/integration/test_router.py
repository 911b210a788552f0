"""Two plugin workers behind SGLang's router (``python -m sglang_kvshare.launch_router``).

One launcher (2 workers on the tiny model + the smg router) serves the whole module; the
kill-a-worker test runs last, since it leaves one worker.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import socket
import time

import psutil
import pytest
import requests

from sglang_kvshare.launch_router import wait_router
from sglang_kvshare.routing import ROUTING_KEY_HEADER, routing_headers
from sglang_kvshare.workflows.transport import ServerError, http_sender
from tests.integration.server import Server
from tests.integration.workflow_helpers import QUESTION, SYSTEM, payload, segments

pytestmark = pytest.mark.integration

SHORT_Q = QUESTION[:400]  # fewer tokens: the CPU is shared with other jobs


def _free_pair() -> int:
    """A port p with p and p + 1 free (the two workers' ports)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", p + 1))
            return p
        except OSError:
            continue
    raise RuntimeError("no two consecutive free ports")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model):
    d = tmp_path_factory.mktemp("router")
    base = _free_pair()
    server = Server(
        ["-m", "sglang_kvshare.launch_router", "--workers", "2", "--worker-base-port", str(base),
         "--log-dir", str(d), "--model-path", tiny_model, "--max-total-tokens", "8192"],
        d / "launcher.log", timeout=1500,
    )
    server.worker_urls = [f"http://127.0.0.1:{base}", f"http://127.0.0.1:{base + 1}"]
    server.model = tiny_model  # the router routes chat by model name (no "default")
    try:
        wait_router(server.url, 2, timeout=120)
    except BaseException:
        server.stop()
        raise
    yield server
    server.stop()
    for url in server.worker_urls:  # the launcher stops them; this only guards against a hung one
        try:
            os.killpg(os.getpgid(_worker_pid(int(url.rsplit(":", 1)[1]))), signal.SIGKILL)
        except (LookupError, ProcessLookupError):
            pass


ROUTED = "x-smg-routed-worker-id"  # the router's response header: the worker that served it
PLACED: dict = {}  # workflow -> the worker its first agent was served by


def post(url: str, body: dict, headers: bool = True, timeout: float = 600) -> requests.Response:
    return requests.post(url + "/generate", json=body, headers=routing_headers(body) if headers else {},
                         timeout=timeout)


def agent_body(workflow: str, agent: str, outputs: dict, max_new_tokens: int = 4) -> dict:
    # each workflow its own question, as in real use (the router's cache_aware placement of a new
    # key then balances instead of following one shared prefix)
    question = f"Case {workflow}. {SHORT_Q}"
    return payload(workflow, agent, "fullshared", segments(agent, outputs, question=question), max_new_tokens)


def test_interleaved_workflows_all_reuse(cluster):
    """6 workflows, their agents interleaved and concurrent: every later agent reuses."""
    workflows = [f"rt-{i}" for i in range(6)]
    outputs = {w: {} for w in workflows}
    later = []
    with cf.ThreadPoolExecutor(3) as pool:
        for agent in ("solver", "critic", "final"):
            bodies = {w: agent_body(w, agent, dict(outputs[w])) for w in workflows}
            replies = dict(zip(workflows, pool.map(lambda w: post(cluster.url, bodies[w]), workflows)))
            for w, r in replies.items():
                assert r.status_code == 200, r.text
                assert PLACED.setdefault(w, r.headers[ROUTED]) == r.headers[ROUTED], (w, agent)
                out = r.json()
                outputs[w][agent] = out["text"]
                if agent != "solver":
                    later.append((w, agent, out["meta_info"]["kvshare"]))
    for w, agent, meta in later:
        assert meta["reused_tokens"] > 0 or meta["injected_tokens"] > 0, (w, agent, meta)
        q = next(s for s in meta["segments"] if s.get("slot") == "q")
        assert q["mode"] == "injected", (w, agent, q)


def test_workflow_sender_and_chat_carry_the_workflow(cluster):
    """Our http sender sets the routing key itself; a chat request (its ``kvshare`` field passes
    the router) with the header reuses too."""
    send = http_sender(cluster.url)
    first = send(agent_body("rt-send", "solver", {}))
    second = send(agent_body("rt-send", "critic", {"solver": first["text"]}))
    assert second["meta_info"]["kvshare"]["injected_tokens"] > 0

    def chat(agent):
        body = {"model": cluster.model, "max_tokens": 3, "temperature": 0,
                "messages": [{"role": "system", "content": SYSTEM[agent]}, {"role": "user", "content": SHORT_Q}],
                "kvshare": {"workflow": "rt-chat", "agent": agent, "method": "fullshared",
                            "shared_messages": {"1": "q"}}}
        r = requests.post(cluster.url + "/v1/chat/completions", json=body, headers=routing_headers(body), timeout=600)
        assert r.status_code == 200, r.text
        return r.json()

    chat("solver")
    seg = chat("critic")["kvshare"]["segments"][1]
    assert seg["slot"] == "q" and seg["mode"] == "injected"


def test_frontend_program_reuses_through_the_router(cluster):
    """An ``@sgl.function`` workflow on ``KVShareEndpoint(router)``: its requests carry the key."""
    from examples.prompt_agents import run_workflow
    from sglang_kvshare.frontend import KVShareEndpoint
    from sglang_kvshare.workflows import get_roles

    endpoint = KVShareEndpoint(cluster.url, method="fullshared", chat_template_name="chatml")
    results = run_workflow(endpoint, get_roles("mmlu").roles[:3], question=SHORT_Q, max_tokens=3, ignore_eos=True)
    for r in results[1:]:
        assert r["kvshare"]["injected_tokens"] > 0, r["kvshare"]


def test_workflows_spread_over_both_workers(cluster):
    """The interleaved workflows were placed on both workers (each pinned to its own), so the
    reuse above needed the affinity."""
    assert len(PLACED) == 6 and set(PLACED.values()) == set(cluster.worker_urls), PLACED


def test_malformed_annotation_gets_400_through_the_router(cluster):
    body = agent_body("rt-bad", "solver", {})
    body["kvshare"]["method"] = "telepathy"
    r = post(cluster.url, body)
    assert r.status_code == 400, r.text
    assert "unknown kvshare method" in r.json()["error"]["message"]
    with pytest.raises(ServerError, match="unknown kvshare method"):
        http_sender(cluster.url)(body)
    assert post(cluster.url, agent_body("rt-bad-ok", "solver", {})).status_code == 200


def _worker_pid(port: int) -> int:
    for c in psutil.net_connections(kind="tcp"):
        if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN and c.pid:
            return c.pid
    raise LookupError(port)


def test_killed_worker_loses_nothing(cluster):
    """Kill one worker between agents: the next agents (not yet started) all get answers, on the
    other worker; the killed worker's workflows get dense fallbacks, the others keep reusing."""
    workflows = [f"kill-{i}" for i in range(6)]
    firsts = {}
    placed = {}
    for w in workflows:
        r = post(cluster.url, agent_body(w, "solver", {}))
        assert r.status_code == 200, r.text
        firsts[w], placed[w] = r.json()["text"], r.headers[ROUTED]
    victim = placed[workflows[0]]
    pid = _worker_pid(int(victim.rsplit(":", 1)[1]))
    os.killpg(os.getpgid(pid), signal.SIGKILL)  # the worker's launch_server and its scheduler
    t0 = time.time()
    with cf.ThreadPoolExecutor(3) as pool:
        replies = list(pool.map(lambda w: post(cluster.url, agent_body(w, "critic", {"solver": firsts[w]})), workflows))
    for w, r in zip(workflows, replies):
        assert r.status_code == 200, (w, r.status_code, r.text)
    metas = [r.json()["meta_info"]["kvshare"] for r in replies]
    dense = [m for m in metas if m["computed_tokens"] == m["prompt_tokens"]]
    reused = [m for m in metas if m["injected_tokens"] > 0]
    assert len(dense) + len(reused) == len(metas)  # each either all dense or reused: never partial
    for w, m in zip(workflows, metas):
        if placed[w] == victim:  # the sources died with the worker: dense prefill, no KV from elsewhere
            assert m in dense and all(s["mode"] == "computed" for s in m["segments"]), (w, m)
        else:
            assert m in reused, (w, m)
    print(f"placed on the victim: {sum(p == victim for p in placed.values())} of {len(placed)}")
    assert all(r.headers[ROUTED] != victim for r in replies)
    # the dense ones continue on the survivor: their next agent reuses the critic's cache there
    i = next(i for i, m in enumerate(metas) if m is dense[0])
    w, critic = workflows[i], replies[i].json()["text"]
    final = post(cluster.url, agent_body(w, "final", {"solver": firsts[w], "critic": critic}))
    assert final.status_code == 200, final.text
    seg = next(s for s in final.json()["meta_info"]["kvshare"]["segments"] if s.get("slot") == "q")
    assert seg["mode"] == "injected" and seg["source_agent"] == "critic"
    print(f"after the kill: {len(dense)} dense, {len(reused)} reused, {time.time() - t0:.1f} s")
