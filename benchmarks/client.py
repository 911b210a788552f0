"""The benchmarks' HTTP client: requests to a running server, each returned as a frozen dataclass.

A streamed OpenAI chat completion is timed as a user's client meets it: time to the first content
token (TTFT), time per output token after it (TPOT), end-to-end latency and the completion's token
count (from the stream's ``usage``). :func:`closed_loop` keeps ``concurrency`` requests in flight.
"""

from __future__ import annotations

import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Sequence

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
        return cls(loads[0].concurrency, tuple(s for load in loads for s in load.streams),
                   sum(load.wall_s for load in loads))

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
    return Stream(ttft if ttft is not None else latency, latency, int(usage.get("completion_tokens", 0)),
                  int(usage.get("prompt_tokens", 0)))


def closed_loop(run: Callable[[dict], Stream], bodies: Sequence[dict], concurrency: int) -> Load:
    """Every body through ``run`` with ``concurrency`` in flight; the streams in body order."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        streams = tuple(pool.map(run, bodies))
    return Load(concurrency, streams, time.perf_counter() - t0)
