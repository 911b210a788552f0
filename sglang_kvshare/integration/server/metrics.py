"""``kvshare_*`` Prometheus metrics on SGLang's ``/metrics`` (``--enable-metrics``).

Recorded in the HTTP (tokenizer) process from each finished annotated request's
``meta_info.kvshare`` record, so they count exactly what the responses report. SGLang runs
prometheus_client in multiprocess mode; metrics created here after its setup land in the same
registry as SGLang's own.

| metric | labels | meaning |
|---|---|---|
| `kvshare_requests_total` | method | finished annotated requests |
| `kvshare_prompt_tokens_total` | method | their prompt tokens |
| `kvshare_reused_tokens_total` | method | prompt tokens not computed (injected, corrected, cached) |
| `kvshare_computed_tokens_total` | method | prompt tokens computed (with reference prefills) |
| `kvshare_injected_tokens_total` | method | tokens written from a source cache (injected or corrected) |
| `kvshare_sourced_tokens_total` | method | tokens of shared segments that had a source (reuse = injected / sourced) |
| `kvshare_recomputed_token_layers_total` | method | token-layers recomputed by selective recomputation |
| `kvshare_recomputed_rows_total` | method | rows of corrected segments recomputed (`--kvshare-fallback rows`) |
| `kvshare_corrections_total` | method, outcome, reason | gated segments: accepted, or rejected by reason |
| `kvshare_correction_seconds` | method | histogram of a request's correction time |
| `kvshare_anchor_bytes` | method | the method's anchor memory (at its last corrected request) |
| `kvshare_lr_bytes` | | LR-cache memory (at the last LR-cache request) |
| `kvshare_detected_spans_total` | kind | repeated runs found by automatic detection, by their source's kind (prompt, output) |
| `kvshare_detected_tokens_total` | kind | their tokens (accepted share = injected / detected tokens) |
| `kvshare_detect_seconds` | | histogram of a request's detection time (HTTP process) |
| `kvshare_auto_prompt_tokens_total` | turn | prompt tokens of detected requests: `first` of their scope, or `later` |
| `kvshare_sources_missing_total` | | requests that refer to earlier turns this worker never served |
| `kvshare_tree_tokens` | SGLang's scheduler labels | KV tokens the radix tree holds (set by the scheduler, `scheduler/requests.py`) |
| `kvshare_view_tokens` | SGLang's scheduler labels | prompt tokens live requests attend in a source's slots (KV views; same) |
"""

from __future__ import annotations

from typing import Any, Optional

TOKEN_COUNTERS = (
    ("prompt_tokens", "Prompt tokens of finished annotated requests"),
    ("reused_tokens", "Prompt tokens reused (injected, corrected or cached), not computed"),
    ("computed_tokens", "Prompt tokens computed, reference prefills included"),
    ("injected_tokens", "Tokens written from a source agent's cache (injected or corrected)"),
    ("recomputed_token_layers", "Token-layers recomputed by selective recomputation"),
    ("recomputed_rows", "Rows of corrected segments recomputed because their gate block was rejected"),
)


class Metrics:
    """The ``kvshare_*`` metrics of this (HTTP) process, created at the first recorded request
    (SGLang sets up its multiprocess registry after the plugin is loaded)."""

    def __init__(self) -> None:
        self._m: Optional[dict[str, Any]] = None

    def _metrics(self) -> dict[str, Any]:
        if self._m is None:
            # imported here: prometheus_client picks its multiprocess mode at import, from the
            # directory SGLang sets up after the plugin is loaded
            from prometheus_client import Counter, Gauge, Histogram

            m: dict[str, Any] = {
                "requests": Counter("kvshare_requests_total", "Finished annotated requests", ["method"]),
                "corrections": Counter(
                    "kvshare_corrections_total",
                    "Gated shared segments by outcome (accepted, rejected) and gate reason",
                    ["method", "outcome", "reason"],
                ),
                "correction_seconds": Histogram(
                    "kvshare_correction_seconds",
                    "Scheduler time of a request's corrections (gather, gate, correct, write)",
                    ["method"],
                    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
                ),
                "anchor_bytes": Gauge(
                    "kvshare_anchor_bytes",
                    "A correction method's anchor memory, bytes",
                    ["method"],
                    multiprocess_mode="mostrecent",
                ),
                "lr_bytes": Gauge("kvshare_lr_bytes", "LR-cache memory, bytes", multiprocess_mode="mostrecent"),
                "sourced": Counter(
                    "kvshare_sourced_tokens_total", "Tokens of shared segments that had a source cache", ["method"]
                ),
                "detected": Counter(
                    "kvshare_detected_spans_total", "Repeated runs found by automatic detection", ["kind"]
                ),
                "detected_tokens": Counter(
                    "kvshare_detected_tokens_total",
                    "Tokens of the repeated runs found by automatic detection",
                    ["kind"],
                ),
                "auto_prompt": Counter(
                    "kvshare_auto_prompt_tokens_total", "Prompt tokens of automatically detected requests", ["turn"]
                ),
                "detect_seconds": Histogram(
                    "kvshare_detect_seconds",
                    "Automatic detection time of a request",
                    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25),
                ),
                "sources_missing": Counter(
                    "kvshare_sources_missing_total", "Requests referring to earlier turns this worker never served"
                ),
            }
            for key, doc in TOKEN_COUNTERS:
                m[key] = Counter(f"kvshare_{key}_total", doc, ["method"])
            self._m = m
        return self._m

    def record(self, meta: Any) -> None:
        """Count one finished request's ``meta_info.kvshare`` record."""
        if not isinstance(meta, dict) or "method" not in meta:
            return
        m, method = self._metrics(), meta["method"]
        m["requests"].labels(method).inc()
        for key, _ in TOKEN_COUNTERS:
            if meta.get(key):
                m[key].labels(method).inc(meta[key])
        sourced = sum(seg.get("tokens", 0) for seg in meta.get("segments") or () if seg.get("source_agent"))
        if sourced:
            m["sourced"].labels(method).inc(sourced)
        for seg in meta.get("segments") or ():
            reason = seg.get("gate")
            if reason is not None:
                outcome = "accepted" if reason == "accepted" else "rejected"
                m["corrections"].labels(method, outcome, reason).inc()
        if meta.get("correction_ms") is not None:
            m["correction_seconds"].labels(method).observe(meta["correction_ms"] / 1000.0)
        if meta.get("anchor_bytes") is not None:
            m["anchor_bytes"].labels(method).set(meta["anchor_bytes"])
        if meta.get("lr_bytes") is not None:
            m["lr_bytes"].set(meta["lr_bytes"])
        auto = meta.get("auto") or {}
        for run in auto.get("detected") or ():
            m["detected"].labels(run["source_kind"]).inc()
            m["detected_tokens"].labels(run["source_kind"]).inc(run["tokens"])
        if auto.get("detect_ms") is not None:
            m["detect_seconds"].observe(auto["detect_ms"] / 1000.0)
            turn = "later" if auto.get("earlier_requests") else "first"
            m["auto_prompt"].labels(turn).inc(meta.get("prompt_tokens") or 0)
        if meta.get("sources_missing"):
            m["sources_missing"].inc()
