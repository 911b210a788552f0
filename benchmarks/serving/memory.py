"""The server's memory while a point runs: RSS of its process tree, GPU memory, KV slots in use;
behind a ``launch_router`` URL, each worker's."""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from typing import Dict, List, Optional

import requests


def find_server_pid(url: str) -> Optional[int]:
    """PID listening on the URL's port on this host (None if not found / not permitted)."""
    import psutil
    from urllib.parse import urlparse

    port = urlparse(url).port
    try:
        for c in psutil.net_connections(kind="tcp"):
            if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN and c.pid:
                return c.pid
    except (psutil.AccessDenied, PermissionError):
        return None
    return None


def tree_rss_mb(pid: int) -> Optional[float]:
    """Resident set size of ``pid`` and all its descendants, MB (None: no such process)."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root] + root.children(recursive=True)
    except psutil.NoSuchProcess:
        return None
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return total / 2**20


def gpu_used_mb() -> Optional[float]:
    """``nvidia-smi`` memory.used summed over GPUs, MB (None without nvidia-smi)."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout
        return float(sum(float(x) for x in out.split()))
    except (subprocess.SubprocessError, ValueError):
        return None


def kv_load(session: requests.Session, url: str) -> Optional[Dict[str, float]]:
    """KV slots in use from SGLang's ``/v1/loads`` (summed over DP ranks), with MB per token."""
    try:
        loads = session.get(url + "/v1/loads", timeout=5).json()["loads"]
        used = sum(float(x.get("num_used_tokens") or 0) for x in loads)
        cap = sum(
            float((x.get("memory") or {}).get("token_capacity") or x.get("max_total_num_tokens") or 0) for x in loads
        )
        gb = sum(float((x.get("memory") or {}).get("kv_cache_gb") or 0) for x in loads)
        return {"used_tokens": used, "mb_per_token": (gb * 1024 / cap) if cap and gb else None}
    except (requests.RequestException, ValueError, KeyError, TypeError):
        return None


def router_worker_urls(url: str) -> List[str]:
    """The workers behind ``url`` when it is a ``launch_router`` URL (the router's ``GET
    /workers``), else [] (one server: SGLang has no such route)."""
    from sglang_kvshare.launch_router import router_workers

    return [w["url"] for w in router_workers(url) or [] if w.get("url")]


def _total(values: List[Optional[float]]) -> Optional[float]:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def _peak(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return b if a is None else a if b is None else max(a, b)


class MemorySampler:
    """Samples, in a thread until the ``with`` block ends: the server tree's RSS (every
    ``interval`` s), GPU memory (nvidia-smi, every 1 s) and KV slots in use (``/v1/loads``,
    every 0.5 s). Behind a router (``launch_router``) it reads each worker instead of the router:
    its process tree (found by its port, so only workers on this host) and its ``/v1/loads``; the
    totals are the peaks of the per-sample sums, ``per_worker()`` each worker's own readings."""

    def __init__(self, pid: Optional[int], url: Optional[str] = None, interval: float = 0.25):
        self.pid, self.url, self.interval = pid, url, interval
        self.worker_urls = router_worker_urls(url) if url else []
        self.targets = [(find_server_pid(w), w) for w in self.worker_urls] or [(pid, url)]
        self.baselines = [tree_rss_mb(p) if p else None for p, _ in self.targets]
        self.peaks_rss = list(self.baselines)
        self.baseline = self.peak_rss = _total(self.baselines)
        self.gpu = shutil.which("nvidia-smi") is not None
        self.peak_gpu = gpu_used_mb() if self.gpu else None
        self._session = requests.Session()
        first = [kv_load(self._session, u) if u else None for _, u in self.targets]
        self.peaks_kv = [f["used_tokens"] if f else None for f in first]  # None: not sampled
        self.peak_kv_tokens = _total(self.peaks_kv)
        self.kv_mb_per_token = next((f["mb_per_token"] for f in first if f), None)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        last_gpu = last_kv = 0.0
        while not self._stop.wait(self.interval):
            rss = [tree_rss_mb(p) if p else None for p, _ in self.targets]
            self.peaks_rss = [_peak(a, b) for a, b in zip(self.peaks_rss, rss)]
            total = _total(rss)
            if total is not None:
                self.peak_rss = max(self.peak_rss or 0.0, total)
            now = time.time()
            if self.gpu and now - last_gpu >= 1.0:
                last_gpu = now
                g = gpu_used_mb()
                if g is not None:
                    self.peak_gpu = max(self.peak_gpu or 0.0, g)
            if self.peak_kv_tokens is not None and now - last_kv >= 0.5:
                last_kv = now
                kv = [
                    kv_load(self._session, u) if peak is not None else None
                    for peak, (_, u) in zip(self.peaks_kv, self.targets)
                ]
                used = [k["used_tokens"] if k else None for k in kv]
                self.peaks_kv = [_peak(a, b) for a, b in zip(self.peaks_kv, used)]
                total = _total(used)
                if total is not None:
                    self.peak_kv_tokens = max(self.peak_kv_tokens, total)

    @property
    def peak_kv_mb(self) -> Optional[float]:
        if self.peak_kv_tokens is None or self.kv_mb_per_token is None:
            return None
        return self.peak_kv_tokens * self.kv_mb_per_token

    @property
    def peak_rss_delta_mb(self) -> Optional[float]:
        """Peak RSS over the RSS just before the block (None when either is unknown)."""
        if self.baseline is None or self.peak_rss is None:
            return None
        return self.peak_rss - self.baseline

    def per_worker(self) -> Optional[Dict[str, Dict[str, Optional[float]]]]:
        """{worker URL: its RSS baseline and peak (MB), peak KV slots in use}; None for one server."""
        if not self.worker_urls:
            return None
        return {
            u: {"rss_baseline_mb": b, "peak_rss_mb": r, "peak_kv_tokens": k}
            for (_, u), b, r, k in zip(self.targets, self.baselines, self.peaks_rss, self.peaks_kv)
        }

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=10)
