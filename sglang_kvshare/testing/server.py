"""Start and stop real SGLang servers (our launch_server or stock SGLang) for tests and benchmarks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from contextlib import contextmanager
from typing import Callable, Iterator, Optional, Sequence

import requests

from sglang_kvshare.router_argv import free_port

STOCK_CPU_FLAGS = [
    "--device",
    "cpu",
    "--attention-backend",
    "torch_native",
    "--disable-cuda-graph",
    "--skip-server-warmup",
    "--dtype",
    "float32",
    "--max-total-tokens",
    "16384",
    "--disable-overlap-schedule",
    "--sleep-on-idle",
]


class Server:
    """A server subprocess on 127.0.0.1; ``stop()`` kills its whole process group.

    A server that exits while starting is started once more on a fresh port, its first log kept
    beside the log (``*.first-start.log``) and its tail printed: on the 2-core CI machine a
    stock server once exited while starting (uvicorn's startup failure, exit 3, after a 10 s
    timeout of SGLang's post-warmup request), which a second start does not repeat; a server
    that cannot start fails both. ``starts=1`` for a test that expects the start to fail."""

    def __init__(
        self,
        argv: Sequence[str],
        log_path: Path,
        env: Optional[dict] = None,
        timeout: float = 300,
        port: Optional[int] = None,
        starts: int = 2,
    ):
        self.log_path = log_path
        full_env = dict(os.environ)
        full_env.pop("TRITON_INTERPRET", None)  # set for the kernel tests only (tests/conftest.py)
        full_env.update(env or {})  # a server that runs Triton on the CPU asks for it here
        for attempt in range(1, starts + 1):
            self.port = port or free_port()
            self.url = f"http://127.0.0.1:{self.port}"
            self._log = open(log_path, "w")
            self.proc = subprocess.Popen(
                [sys.executable, *argv, "--host", "127.0.0.1", "--port", str(self.port)],
                stdout=self._log,
                stderr=subprocess.STDOUT,
                env=full_env,
                start_new_session=True,
            )
            try:
                self._wait(timeout)
                return
            except RuntimeError as e:
                self.stop()
                if attempt == starts:
                    raise
                kept = log_path.with_name(log_path.name + ".first-start.log")
                log_path.replace(kept)
                print(f"server.py: {argv[1]} exited while starting; starting it again ({kept}):\n{e}", file=sys.stderr)

    def _wait(self, timeout: float) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}):\n{self.log_tail()}")
            try:
                if requests.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(1)
        self.stop()
        raise TimeoutError(f"server not ready in {timeout}s:\n{self.log_tail()}")

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def generate(self, payload: dict, timeout: float = 300) -> requests.Response:
        return requests.post(self.url + "/generate", json=payload, timeout=timeout)

    def stream(self, payload: dict, timeout: float = 300) -> list[dict]:
        """POST a streamed /generate; returns its server-sent events (parsed)."""
        events = []
        with requests.post(self.url + "/generate", json={**payload, "stream": True}, stream=True, timeout=timeout) as r:
            assert r.status_code == 200, r.text
            for line in r.iter_lines():
                if line.startswith(b"data: ") and line != b"data: [DONE]":
                    events.append(json.loads(line[len(b"data: ") :]))
        return events

    def stop(self) -> None:
        """SIGTERM to the group (30 s to exit), then SIGKILL to whatever of it is left, also when
        the server process itself had already exited (its scheduler or detokenizer may not have)."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=30)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._log.close()


@contextmanager
def running(*starters: Callable[[], Server]) -> Iterator[list[Server]]:
    """Start servers in order; stop every one that started, whatever happens."""
    started: list[Server] = []
    try:
        for start in starters:
            started.append(start())
        yield started
    finally:
        for server in started:
            server.stop()


def kvshare_server(model_path: str, log_path: Path, *extra: str, **kw) -> Server:
    return Server(["-m", "sglang_kvshare.launch_server", "--model-path", model_path, *extra], log_path, **kw)


def stock_server(model_path: str, log_path: Path, *extra: str, plugin: bool = False, **kw) -> Server:
    """Stock SGLang (torch_native attention, its default radix tree). ``plugin=True`` loads our
    plugin only for its CPU shims (LoRA needs them without CUDA); its hooks act on annotated
    requests alone, and this server is sent none."""
    env = {} if plugin else {"SGLANG_PLUGINS": "none"}
    return Server(
        ["-m", "sglang.launch_server", "--model-path", model_path, *STOCK_CPU_FLAGS, *extra], log_path, env=env, **kw
    )


def agents_python() -> str:
    """The python of the agent frameworks' venv (``scripts/setup.sh``: ``$KVSHARE_AGENTS_VENV``,
    else this venv's name + ``-agents``)."""
    default = Path(sys.prefix).with_name(Path(sys.prefix).name + "-agents")
    venv = Path(os.environ.get("KVSHARE_AGENTS_VENV", str(default)))
    python = venv / "bin" / "python"
    assert python.exists(), f"the agent frameworks' venv {venv} is missing: run scripts/setup.sh"
    return str(python)
