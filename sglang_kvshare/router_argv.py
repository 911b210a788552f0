"""The command lines ``launch_router`` starts: the router's (``python -m smg.launch_router`` with
our defaults) and each plugin worker's (``python -m sglang_kvshare.launch_server``)."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path
from typing import List, Sequence

from sglang_kvshare.launch_server import flag_value, has_flag, without_flag
from sglang_kvshare.routing import ROUTING_KEY_HEADER
from sglang_kvshare.segments.detect import WORKFLOW_HEADER

# What the router gets unless --router-arg sets the flag. Affinity: the routing-key override on
# the default policy (the first request of a key is placed by cache_aware, then pinned).
# Faults: CPU workers can be slow to answer /health under load, so a worker is taken out after 2
# failed probes 5 s apart (timeout 20 s); a request that meets a dead worker is retried (smg's
# retries, with backoff) and the circuit breaker takes the worker out after 2 failures.
ROUTER_DEFAULTS = (
    ("--policy", "cache_aware"),
    ("--routing-key-override", None),
    ("--routing-key-headers", (WORKFLOW_HEADER, ROUTING_KEY_HEADER.lower())),
    ("--health-check-interval-secs", "5"),
    ("--health-check-timeout-secs", "20"),
    ("--health-failure-threshold", "2"),
    ("--health-success-threshold", "1"),
    ("--cb-failure-threshold", "2"),
    ("--cb-timeout-duration-secs", "10"),
    ("--retry-max-retries", "6"),
    ("--retry-max-backoff-ms", "4000"),
    ("--request-timeout-secs", "3600"),
    ("--shutdown-grace-period-secs", "5"),
    ("--worker-startup-timeout-secs", "1800"),
    ("--log-level", "warn"),
)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def router_argv(router_host: str, router_port: int, worker_urls: Sequence[str], extra: Sequence[str]) -> List[str]:
    argv = ["--host", router_host, "--port", str(router_port), "--worker-urls", *worker_urls]
    if not has_flag(extra, "--prometheus-port"):  # smg's default, 0.0.0.0:29000, clashes between routers
        argv += ["--prometheus-host", router_host, "--prometheus-port", str(free_port(router_host))]
    for flag, value in ROUTER_DEFAULTS:
        if not has_flag(extra, flag):
            argv += [flag] if value is None else [flag, *value] if isinstance(value, tuple) else [flag, value]
    return argv + list(extra)


def worker_anchor_pool(path: str, index: int, workers: int) -> str:
    """Worker ``index``'s own anchor-pool file (one file per writer): ``<stem>.w<i><suffix>``."""
    if workers <= 1:
        return path
    p = Path(path)
    return str(p.with_name(f"{p.stem}.w{index}{p.suffix}"))


def worker_argv(rest: Sequence[str], host: str, port: int, index: int, workers: int) -> List[str]:
    """Worker ``index``'s command. ``--kvshare-anchor-pool PATH`` becomes the worker's own file;
    when ``PATH`` exists (and no ``--kvshare-anchor-pool-seed`` is given) it is the seed: a worker
    without its own file yet starts warm from it (read only, checked by the worker)."""
    argv = list(rest)
    pool = flag_value(argv, "--kvshare-anchor-pool")
    if pool:
        own = worker_anchor_pool(pool, index, workers)
        argv = without_flag(argv, "--kvshare-anchor-pool") + ["--kvshare-anchor-pool", own]
        if own != pool and os.path.exists(pool) and not has_flag(argv, "--kvshare-anchor-pool-seed"):
            argv += ["--kvshare-anchor-pool-seed", pool]
    return [sys.executable, "-m", "sglang_kvshare.launch_server", *argv, "--host", host, "--port", str(port)]
