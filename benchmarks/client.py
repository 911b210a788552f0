"""The benchmarks' HTTP client: requests to a running server, each returned as a frozen dataclass.

A streamed OpenAI chat completion is timed as a user's client meets it: time to the first content
token (TTFT), time per output token after it (TPOT), end-to-end latency and the completion's token
count (from the stream's ``usage``). :func:`closed_loop` keeps ``concurrency`` requests in flight.
:func:`stream_generate` times a streamed native ``/generate`` the same way (to its first SSE data
chunk) and keeps the last chunk's ``meta_info``; :class:`Percentiles` summarises timings.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence

import requests


@dataclass(frozen=True)
class Stream:
    """One streamed completion, timed at the client."""

    ttft_s: float
    latency_s: float
    output_tokens: int
    prompt_tokens: int

    @property
    def tpot_s(self) -> float:
        """Time per output token after the first (0 for a one-token answer)."""
        return (self.latency_s - self.ttft_s) / max(1, self.output_tokens - 1)


@dataclass(frozen=True)
class Load:
    """Requests run with ``concurrency`` in flight: their streams and the wall time of the whole."""

    concurrency: int
    streams: tuple[Stream, ...]
    wall_s: float

    @property
    def output_tokens(self) -> int:
        return sum(s.output_tokens for s in self.streams)

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s

    @classmethod
    def joined(cls, loads: Sequence["Load"]) -> "Load":
        """Loads run one after another (same concurrency) as one: their streams, their wall times summed."""
        return cls(
            loads[0].concurrency, tuple(s for load in loads for s in load.streams), sum(load.wall_s for load in loads)
        )

    def median(self, field: str) -> float:
        return statistics.median(getattr(s, field) for s in self.streams)


def stream_chat(url: str, body: dict, headers: dict | None = None, timeout: float = 1800) -> Stream:
    """POST ``body`` streamed to ``url``/v1/chat/completions; raises on an HTTP error."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft = None
    usage = {}
    with requests.post(url + "/v1/chat/completions", json=body, headers=headers, stream=True, timeout=timeout) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:500]}")
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft is None and any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                ttft = time.perf_counter() - t0
            usage = chunk.get("usage") or usage
    latency = time.perf_counter() - t0
    return Stream(
        ttft if ttft is not None else latency,
        latency,
        int(usage.get("completion_tokens", 0)),
        int(usage.get("prompt_tokens", 0)),
    )


def closed_loop(run: Callable[[dict], Stream], bodies: Sequence[dict], concurrency: int) -> Load:
    """Every body through ``run`` with ``concurrency`` in flight; the streams in body order."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        streams = tuple(pool.map(run, bodies))
    return Load(concurrency, streams, time.perf_counter() - t0)


class RequestFailed(RuntimeError):
    """A streamed ``/generate`` that did not complete: an HTTP error, an error chunk, a timeout."""


@dataclass(frozen=True)
class Generated:
    """One streamed ``/generate``, timed at the client: to the first SSE data chunk (``ttft_s``) and
    to the last (``e2e_s``); ``text`` and ``meta`` (``meta_info``) of the last chunk."""

    ttft_s: float
    e2e_s: float
    text: str
    meta: dict


def stream_generate(
    session: requests.Session, url: str, payload: dict, timeout: float, headers: dict | None = None
) -> Generated:
    """POST ``payload`` streamed to ``url``/generate; raises :class:`RequestFailed` on an HTTP
    error, an error chunk, an empty stream or a stream running past ``timeout`` seconds."""
    t0 = time.perf_counter()
    with session.post(
        url + "/generate", json=dict(payload, stream=True), stream=True, timeout=timeout, headers=headers
    ) as r:
        if r.status_code != 200:
            raise RequestFailed(f"HTTP {r.status_code}: {r.text[:1000]}")
        ttft, last = None, None
        for line in r.iter_lines():
            if not line or not line.startswith(b"data:"):
                continue
            if line.strip() == b"data: [DONE]":
                break
            if ttft is None:
                ttft = time.perf_counter() - t0
            last = json.loads(line[5:])
            if time.perf_counter() - t0 > timeout:
                raise RequestFailed(f"request exceeded {timeout}s")
    e2e = time.perf_counter() - t0
    if last is None:
        raise RequestFailed("stream ended without data")
    if "error" in last:
        raise RequestFailed(str(last["error"])[:1000])
    return Generated(ttft, e2e, last.get("text", ""), last.get("meta_info", {}))


@dataclass(frozen=True)
class Percentiles:
    """p50/p90/p99 (linear interpolation between closest ranks), mean and count of some values."""

    p50: float
    p90: float
    p99: float
    mean: float
    n: int

    @classmethod
    def of(cls, values: Iterable[Optional[Any]]) -> Optional["Percentiles"]:
        """Of the values that are not None; None when there are none."""
        vals = sorted(v for v in values if v is not None)
        if not vals:
            return None

        def q(p: float) -> float:
            k = (len(vals) - 1) * p / 100
            lo, hi = math.floor(k), math.ceil(k)
            return vals[lo] + (vals[hi] - vals[lo]) * (k - lo)

        return cls(q(50), q(90), q(99), statistics.fmean(vals), len(vals))
