"""Two plugin workers behind SGLang's router (``python -m sglang_kvshare.launch_router``).

One launcher (2 workers on the tiny model + the smg router) serves the whole module; the
kill-a-worker test runs after the others, since it leaves one worker, and the restart test
brings that worker back (started by the test, on the same port).
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import requests

from sglang_kvshare.correction.warm_start import SAVE_KEY
from sglang_kvshare.launch_router import wait_router
from sglang_kvshare.router_argv import worker_anchor_pool, worker_argv
from sglang_kvshare.routing import routing_headers
from sglang_kvshare.testing.server import Server
from sglang_kvshare.testing.workflows import QUESTION, SYSTEM, payload, segments, settle
from sglang_kvshare.workflows.transport import ServerError, http_sender

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
    # each worker keeps its anchor pools in its own file (anchors.w0.pt, anchors.w1.pt)
    worker_flags = [
        "--model-path",
        tiny_model,
        "--max-total-tokens",
        "8192",
        "--kvshare-anchor-pool",
        str(d / "anchors.pt"),
        "--kvshare-auto",
        "fullshared",
    ]
    server = Server(
        [
            "-m",
            "sglang_kvshare.launch_router",
            "--workers",
            "2",
            "--worker-base-port",
            str(base),
            "--log-dir",
            str(d),
            *worker_flags,
        ],
        d / "launcher.log",
        timeout=1500,
    )
    server.dir, server.worker_flags, server.pool = d, worker_flags, str(d / "anchors.pt")
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
KILLED: dict = {}  # "url": the worker test_killed_worker_loses_nothing killed


def post(url: str, body: dict, headers: bool = True, timeout: float = 600) -> requests.Response:
    return requests.post(
        url + "/generate", json=body, headers=routing_headers(body) if headers else {}, timeout=timeout
    )


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
        body = {
            "model": cluster.model,
            "max_tokens": 3,
            "temperature": 0,
            "messages": [{"role": "system", "content": SYSTEM[agent]}, {"role": "user", "content": SHORT_Q}],
            "kvshare": {"workflow": "rt-chat", "agent": agent, "method": "fullshared", "shared_messages": {"1": "q"}},
        }
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


def test_unannotated_agents_are_pinned_by_the_workflow_header(cluster):
    """Automatic sharing behind the router (workers started with ``--kvshare-auto``): the
    ``X-KVShare-Workflow`` header pins each workflow to one worker and its later agents reuse the
    report they did not mark. smg forwards ``Authorization`` but not our headers, so on the worker
    the scope is the API key."""
    workflows = [f"rt-auto-{i}" for i in range(4)]

    def chat(workflow, agent):
        body = {
            "model": cluster.model,
            "max_tokens": 3,
            "temperature": 0,
            "messages": [
                {"role": "system", "content": SYSTEM[agent]},
                {"role": "user", "content": f"Case {workflow}. {SHORT_Q}"},
            ],
        }
        headers = {"X-KVShare-Workflow": workflow, "Authorization": f"Bearer tenant-{workflow}"}
        r = requests.post(cluster.url + "/v1/chat/completions", json=body, headers=headers, timeout=600)
        assert r.status_code == 200, r.text
        return r.headers[ROUTED], r.json()["kvshare"]

    with cf.ThreadPoolExecutor(2) as pool:
        first = dict(zip(workflows, pool.map(lambda w: chat(w, "solver"), workflows)))
        later = dict(zip(workflows, pool.map(lambda w: chat(w, "critic"), workflows)))
    assert {w: r[1]["auto"]["scope"] for w, r in later.items()} == {w: "api_key" for w in workflows}
    for w in workflows:
        assert later[w][0] == first[w][0], w
        assert later[w][1]["injected_tokens"] > 0 and not later[w][1].get("sources_missing"), later[w][1]


def test_serving_benchmark_reads_each_workers_memory(cluster):
    """``benchmarks.serving --url <router>``: its memory sampler reads the workers behind the
    router (their process trees and /v1/loads), not the router process."""
    from benchmarks.serving.memory import MemorySampler, find_server_pid, router_worker_urls, tree_rss_mb

    assert sorted(router_worker_urls(cluster.url)) == sorted(cluster.worker_urls)
    assert router_worker_urls(cluster.worker_urls[0]) == []  # one server: no workers route
    with MemorySampler(find_server_pid(cluster.url), cluster.url, interval=0.1) as mem:
        assert post(cluster.url, agent_body("rt-mem", "solver", {}, 8)).status_code == 200
        time.sleep(0.6)
    per = mem.per_worker()
    assert set(per) == set(cluster.worker_urls), per
    for url, m in per.items():
        # a worker's tree holds SGLang, torch and the model: far more than the router's
        assert m["peak_rss_mb"] >= m["rss_baseline_mb"] > tree_rss_mb(find_server_pid(cluster.url)), (url, m)
        assert m["peak_kv_tokens"] is not None, (url, m)
    peaks = [m["peak_rss_mb"] for m in per.values()]
    assert max(peaks) < mem.peak_rss <= sum(peaks) + 1e-6  # the peak of the sums
    assert mem.peak_kv_tokens is not None and mem.kv_mb_per_token
    worker = cluster.worker_urls[0]  # a worker's own URL: one server, as before
    with MemorySampler(find_server_pid(worker), worker, interval=0.1) as one:
        time.sleep(0.3)
    assert one.per_worker() is None and one.peak_rss == pytest.approx(per[worker]["peak_rss_mb"], rel=0.2)
    assert one.peak_kv_tokens is not None


def _worker_pid(port: int) -> int:
    for c in psutil.net_connections(kind="tcp"):
        if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN and c.pid:
            return c.pid
    raise LookupError(port)


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def _kill(url: str) -> str:
    pid = _worker_pid(_port(url))
    os.killpg(os.getpgid(pid), signal.SIGKILL)  # the worker's launch_server and its scheduler
    KILLED["url"] = url
    return url


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
    _kill(victim)
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


def _kvcmas_body(workflow: str, agent: str, outputs: dict) -> dict:
    """A kvcmas agent whose question lives in slot ``q-warm`` (its own anchor pool); tau 1: a
    correction is accepted whenever two compatible anchors exist."""
    segs = segments(agent, outputs, question=f"Case {workflow}. {SHORT_Q}", slot="q-warm")
    return payload(workflow, agent, "kvcmas", segs, 4, tau=1.0)


def _kvcmas_workflows(url: str, workflows, threads: int = 1):
    """solver then critic of each workflow (the agents of one stage concurrently); returns
    {workflow: (solver reply, critic reply)}."""
    solver = {}
    with cf.ThreadPoolExecutor(threads) as pool:
        for w, r in zip(workflows, pool.map(lambda w: post(url, _kvcmas_body(w, "solver", {})), workflows)):
            assert r.status_code == 200, (w, r.status_code, r.text)
            solver[w] = r
        critic = dict(
            zip(
                workflows,
                pool.map(
                    lambda w: post(url, _kvcmas_body(w, "critic", {"solver": solver[w].json()["text"]})), workflows
                ),
            )
        )
    for w, r in critic.items():
        assert r.status_code == 200, (w, r.status_code, r.text)
    return {w: (solver[w], critic[w]) for w in workflows}


def _q_warm(reply) -> dict:
    return next(s for s in reply.json()["meta_info"]["kvshare"]["segments"] if s.get("slot") == "q-warm")


def test_restarted_worker_rejoins_and_starts_warm_from_a_sibling_pool(cluster):
    """The killed worker, restarted on its port with its launcher flags plus
    ``--kvshare-anchor-pool-seed`` (the survivor's saved pool file): nothing fails while it
    starts; once its health checks pass the router places new workflows on it again, each
    pinned there, and its first kvcmas workflows are corrected from the seeded anchors."""
    victim = KILLED.get("url") or _kill(cluster.worker_urls[1])
    survivor = next(u for u in cluster.worker_urls if u != victim)
    index, s_index = cluster.worker_urls.index(victim), cluster.worker_urls.index(survivor)
    # the survivor's anchors: two workflows (through the router: the survivor is its only live
    # worker) whose critics fall back densely, each adding an anchor; then saved to its own file
    for w, (_, critic) in _kvcmas_workflows(cluster.url, ["warm-0", "warm-1"]).items():
        assert critic.headers[ROUTED] == survivor, w
        assert _q_warm(critic)["mode"] == "dense_fallback", _q_warm(critic)
    anchors = settle(SimpleNamespace(url=survivor))["correctors"]["kvcmas"]["num_anchors"]
    # 2 for the critic's q-warm; the solver's 4-token answer lies within the head rows
    # (--kvshare-recompute-head): computed, no anchor
    assert anchors == 2
    saved = requests.post(survivor + "/set_internal_state", json={"server_args": {SAVE_KEY: 1}}, timeout=120)
    assert saved.status_code == 200 and saved.json() == [True], saved.text  # "updated", one rank
    seed = worker_anchor_pool(cluster.pool, s_index, 2)
    assert Path(seed).stat().st_size > 0
    own = worker_anchor_pool(cluster.pool, index, 2)
    assert not Path(own).exists(), "the killed worker never saved (no anchors before the kill)"

    # traffic through the router while the worker starts (a request every 2 s): all answered
    stop, codes = threading.Event(), []

    def traffic():
        i = 0
        while not stop.is_set():
            codes.append(post(cluster.url, agent_body(f"during-{i}", "solver", {}, 2)).status_code)
            i += 1
            stop.wait(2.0)

    t0 = time.time()
    background = threading.Thread(target=traffic, daemon=True)
    background.start()
    argv = worker_argv(cluster.worker_flags, "127.0.0.1", _port(victim), index, 2)
    assert argv[-4:] == ["--host", "127.0.0.1", "--port", str(_port(victim))]
    restarted = None
    try:
        restarted = Server(
            [*argv[1:-4], "--kvshare-anchor-pool-seed", seed],
            cluster.dir / "restarted.log",
            timeout=900,
            port=_port(victim),
        )
        wait_router(cluster.url, 2, timeout=120)  # registered and healthy again
        rejoined = time.time() - t0
        stop.set()
        background.join(timeout=120)
        assert codes and all(c == 200 for c in codes), codes
        state = settle(restarted)
        assert state["anchor_pool_loaded"]["path"] == seed, state["anchor_pool_loaded"]
        assert state["anchor_pool_loaded"]["anchors"] == anchors, state["anchor_pool_loaded"]
        assert state["correctors"]["kvcmas"]["num_anchors"] == anchors, state["correctors"]

        # new workflows through the router, 3 at a time, until both workers got some (the router
        # places a new key by its policy; 6 workflows put 1 to 3 on the restarted worker in our runs)
        replies = {}
        for batch in range(8):
            replies.update(_kvcmas_workflows(cluster.url, [f"back-{3 * batch + i}" for i in range(3)], threads=3))
            placed = {w: s.headers[ROUTED] for w, (s, _) in replies.items()}
            if set(placed.values()) == set(cluster.worker_urls):
                break
        assert set(placed.values()) == set(cluster.worker_urls), placed
        for w, (solver, critic) in replies.items():
            assert critic.headers[ROUTED] == placed[w], w
            q = _q_warm(critic)
            # every later agent reuses; on the restarted worker its first workflows are already
            # corrected with the seed's two anchors (a cold worker has none: dense fallback)
            assert q["mode"] == "corrected" and q["gate"] == "accepted" and q["anchors"] >= 2, (w, placed[w], q)
        print(
            f"rejoined after {rejoined:.1f} s ({len(codes)} requests meanwhile, all 200); "
            f"{sum(p == victim for p in placed.values())} of {len(placed)} new workflows on it, all corrected"
        )
    finally:
        stop.set()
        if restarted is not None:
            restarted.stop()


def test_a_missing_seed_stops_the_worker_with_its_reason(tmp_path, tiny_model):
    """A ``--kvshare-anchor-pool-seed`` that does not exist stops the worker before its model
    loads, and the launcher's error shows the worker's reason (a corrupt or another model's
    file: tests/unit/test_launch_router.py, the same check)."""
    base = _free_pair()
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "sglang_kvshare.launch_router",
            "--workers",
            "1",
            "--port",
            str(base + 1),
            "--worker-base-port",
            str(base),
            "--log-dir",
            str(tmp_path),
            "--model-path",
            tiny_model,
            "--kvshare-anchor-pool-seed",
            str(tmp_path / "missing.pt"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode != 0
    assert "worker-0 exited" in r.stderr, r.stderr
    assert f"--kvshare-anchor-pool-seed: {tmp_path / 'missing.pt'} does not exist" in r.stderr, r.stderr
