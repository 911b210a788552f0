"""``python -m sglang_kvshare.launch_router``: N plugin workers behind SGLang's router (smg), one URL.

``--workers N`` starts N workers with ``python -m sglang_kvshare.launch_server`` (every flag this
command does not take goes to each of them) on ports ``--worker-base-port``, +1, ...; ``--worker-url
URL`` (repeatable) adds workers started by hand, on this host or others. When the workers answer
``/health``, the router (``python -m smg.launch_router``) starts on ``--host``/``--port`` in front of
them, with workflow affinity: ``--routing-key-override`` pins every request that carries the
``X-KVShare-Workflow`` header (the scope of automatic sharing) or the ``X-SMG-Routing-Key`` header
(our clients put ``kvshare.workflow`` there, see ``sglang_kvshare.routing``) to one worker; the
first present wins; requests without either keep the router's policy
(``cache_aware`` unless ``--router-arg=--policy=...``). ``--router-arg=FLAG`` (repeatable) passes a
flag to the router.

With ``--kvshare-anchor-pool PATH`` and several workers, worker i keeps its own file
``<stem>.w<i><suffix>``; when ``PATH`` exists it is every worker's ``--kvshare-anchor-pool-seed``
(read only; a worker loads it while it has no file of its own yet).

SIGTERM/SIGINT/SIGHUP stop the router first, then the workers (SIGTERM to each process group, so
the workers save their anchor pools; SIGKILL after ``--stop-timeout`` s). A worker that dies is
left to the router (its health checks take it out; restarted on the same port it rejoins); the
launcher exits when the router exits.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import List, Optional, Sequence

from sglang_kvshare.router_argv import router_argv, worker_argv

PROG = "python -m sglang_kvshare.launch_router"


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, List[str]]:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0], add_help=False)
    parser.add_argument("--workers", type=int, default=2, help="plugin workers to start here (default 2)")
    parser.add_argument("--host", default="127.0.0.1", help="the router's host (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=30000, help="the router's port (default 30000)")
    parser.add_argument("--worker-host", default="127.0.0.1", help="host the local workers bind")
    parser.add_argument(
        "--worker-base-port", type=int, default=None, help="port of the first local worker (default: router port + 1)"
    )
    parser.add_argument(
        "--worker-url",
        action="append",
        default=[],
        help="a worker started by hand (python -m sglang_kvshare.launch_server ...), repeatable",
    )
    parser.add_argument(
        "--router-arg",
        action="append",
        default=[],
        help="a flag for the router (smg), e.g. --router-arg=--policy=round_robin; repeatable",
    )
    parser.add_argument(
        "--log-dir", default=None, help="write worker-<i>.log and router.log here (default: this terminal)"
    )
    parser.add_argument(
        "--worker-timeout", type=float, default=1800, help="seconds to wait for the workers' /health (default 1800)"
    )
    parser.add_argument(
        "--stop-timeout",
        type=float,
        default=20,
        help="seconds the children get after SIGTERM before SIGKILL (default 20)",
    )
    parser.add_argument("-h", "--help", action="store_true")
    ns, rest = parser.parse_known_args(list(argv))
    if ns.help:
        parser.print_help()
        print("\nEvery other flag goes to each worker: see python -m sglang_kvshare.launch_server --help")
        sys.exit(0)
    if ns.workers < 0 or (ns.workers == 0 and not ns.worker_url):
        parser.error("give --workers N >= 1 or at least one --worker-url")
    return ns, rest


def router_workers(url: str, timeout: float = 5) -> Optional[List[dict]]:
    """The router's registered workers (``GET /workers``), None if it does not answer."""
    try:
        with urllib.request.urlopen(url + "/workers", timeout=timeout) as r:
            return json.loads(r.read())["workers"]
    except Exception:
        return None


def wait_router(url: str, n: int, timeout: float = 600, proc: Optional[subprocess.Popen] = None) -> None:
    """Wait until the router at ``url`` has ``n`` healthy workers registered (its ``/health``
    answers before it has any)."""
    deadline = time.time() + timeout
    while True:
        workers = router_workers(url) or []
        if len(workers) >= n and all(w.get("is_healthy", True) for w in workers):
            return
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the router exited ({proc.returncode}) before it was ready")
        if time.time() > deadline:
            raise RuntimeError(f"the router at {url} has {len(workers)} of {n} healthy workers after {timeout} s")
        time.sleep(0.5)


def healthy(url: str, timeout: float = 5) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=timeout) as r:
            return r.status == 200
    except Exception:
        return False


class Launcher:
    def __init__(self, ns: argparse.Namespace, rest: List[str]):
        self.ns = ns
        self.rest = rest
        self.children: List[tuple[str, subprocess.Popen]] = []  # (name, process), start order
        self.stopping = False
        self._logs = []

    def _out(self, name: str):
        if not self.ns.log_dir:
            return None
        Path(self.ns.log_dir).mkdir(parents=True, exist_ok=True)
        f = open(Path(self.ns.log_dir) / f"{name}.log", "ab")
        self._logs.append(f)
        return f

    def _log_tail(self, name: str, n: int = 5) -> str:
        """The last ``n`` lines of a child's log (empty without ``--log-dir``: it wrote here)."""
        if not self.ns.log_dir:
            return ""
        try:
            lines = (Path(self.ns.log_dir) / f"{name}.log").read_text(errors="replace").splitlines()
        except OSError:
            return ""
        tail = [line for line in lines if line.strip()][-n:]
        return "".join(f"\n  {line}" for line in tail)

    def _spawn(self, name: str, argv: List[str]) -> subprocess.Popen:
        out = self._out(name)
        proc = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT if out else None, start_new_session=True
        )  # its own process group: signalled as one
        self.children.append((name, proc))
        print(f"{PROG}: started {name} (pid {proc.pid}): {' '.join(argv[1:])}", file=sys.stderr, flush=True)
        return proc

    def start_workers(self) -> List[str]:
        ns = self.ns
        base = ns.worker_base_port if ns.worker_base_port is not None else ns.port + 1
        urls = []
        for i in range(ns.workers):
            port = base + i
            self._spawn(f"worker-{i}", worker_argv(self.rest, ns.worker_host, port, i, ns.workers))
            urls.append(f"http://{ns.worker_host}:{port}")
        return urls + [u.rstrip("/") for u in ns.worker_url]

    def wait_workers(self, urls: List[str]) -> None:
        deadline = time.time() + self.ns.worker_timeout
        pending = list(urls)
        while pending:
            for name, proc in self.children:
                if proc.poll() is not None:
                    raise SystemExit(
                        f"{PROG}: {name} exited ({proc.returncode}) before it was ready{self._log_tail(name)}"
                    )
            pending = [u for u in pending if not healthy(u)]
            if not pending:
                return
            if time.time() > deadline or self.stopping:
                raise SystemExit(f"{PROG}: workers not ready: {' '.join(pending)}")
            time.sleep(1)

    def stop(self) -> None:
        """Router first (no new requests reach the workers), then the workers, all within
        ``--stop-timeout`` seconds; SIGKILL to whatever is left."""
        deadline = time.time() + self.ns.stop_timeout
        for name, proc in reversed(self.children):  # the router was started last
            self._signal(proc, signal.SIGTERM)
            if name == "router":
                self._wait(proc, min(deadline, time.time() + self.ns.stop_timeout / 3))
        for name, proc in self.children:
            if not self._wait(proc, deadline):
                self._signal(proc, signal.SIGKILL)
                proc.wait()
        for f in self._logs:
            f.close()

    @staticmethod
    def _signal(proc: subprocess.Popen, sig: int) -> None:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass

    @staticmethod
    def _wait(proc: subprocess.Popen, deadline: float) -> bool:
        try:
            proc.wait(timeout=max(0.0, deadline - time.time()))
            return True
        except subprocess.TimeoutExpired:
            return False

    def run(self) -> int:
        def on_signal(signum, frame):
            self.stopping = True
            raise KeyboardInterrupt

        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, on_signal)
        try:
            urls = self.start_workers()
            self.wait_workers(urls)
            ns = self.ns
            router = self._spawn(
                "router",
                [sys.executable, "-m", "smg.launch_router", *router_argv(ns.host, ns.port, urls, ns.router_arg)],
            )
            url = f"http://{ns.host}:{ns.port}"
            wait_router(url, len(urls), proc=router)
            print(
                f"{PROG}: ready: {len(urls)} workers ({' '.join(urls)}) behind the router at {url}",
                file=sys.stderr,
                flush=True,
            )
            return router.wait()
        except KeyboardInterrupt:
            return 0
        except RuntimeError as e:
            print(f"{PROG}: {e}", file=sys.stderr, flush=True)
            return 1
        finally:
            self.stop()


def main(argv: Optional[Sequence[str]] = None) -> None:
    ns, rest = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        import smg.launch_router  # noqa: F401  (the router; requirements/extra.txt)
    except ImportError as e:
        sys.exit(f"{PROG}: the router package is missing ({e}); pip install smg==1.13.0")
    sys.exit(Launcher(ns, rest).run())


if __name__ == "__main__":
    main()
