"""Serving benchmark: controlled multi-agent traces at rising workflow arrival rates, per method.

A *workflow* is one run of a fixed agent schedule (``sglang_kvshare.workflows.build_schedule``,
topology ``loop``): ``--base-agents`` agents (task agents ``agent0..`` then ``final``) over
``--base-rounds`` rounds; every agent reads the shared context (slot ``q``) and the latest output
of every task agent so far (slots ``out:<agent>``), laid out by ``build_segments`` (ChatML). Every
agent output has exactly ``--output-len`` tokens (``max_new_tokens`` fixed, ``ignore_eos: true``)
and is fed unchanged into later agents' inputs. Each workflow gets its own shared context of
``N`` tokens (numbered facts, unique per workflow), swept over ``--contexts``.

Arrivals: for each rate ``λ`` (workflows/s) in ``--rates``, ``--workflows`` workflows arrive as a
Poisson process (seeded: every method sees the same arrival times); a workflow's agents run in
order, workflows overlap. Rate ``0`` means single stream: workflows one after another. Rates rise
until every method is saturated (its median workflow latency exceeds ``--saturation-factor`` x
its latency at the lowest rate measured); higher rates are then skipped for that context.

Metrics per (context, rate, method), all from one run of this script:

- TTFT p50/p90/p99: every request is streamed (``"stream": true``); TTFT is the client wall time
  from sending the POST to receiving the first SSE data chunk on 127.0.0.1 (tokenisation,
  queueing, prefill/injection and the first token). ``ttft_later_s``: the same over agents after
  the first turn (those that can reuse).
- ``e2e_s``: request latency (POST to last chunk); ``workflow_latency_s``: arrival of a workflow
  to its last agent's last chunk.
- ``output_tok_s`` / ``total_tok_s``: output (resp. prompt+output) tokens of all requests divided
  by the makespan (first arrival to last completion).
- ``peak_rss_mb``: peak resident set size summed over the server's process tree (psutil, sampled
  every 0.25 s while the point runs); ``peak_rss_delta_mb`` subtracts the RSS just before it.
  ``peak_gpu_mb``: peak ``nvidia-smi`` memory.used when a GPU is present, else null (both are
  dominated by SGLang's preallocated KV pool). ``peak_kv_tokens`` / ``peak_kv_mb``: peak KV slots
  in use (SGLang's ``/v1/loads`` ``num_used_tokens``, sampled every 0.5 s) and their size.
  Through a ``launch_router`` URL these read the workers, not the router: the peaks of the sums
  over the workers (the RSS of those on this host), and ``workers_memory`` each worker's own.
- ``rho`` = reused / shared tokens summed over all requests (``meta_info.kvshare.reused_tokens``,
  which also counts ordinary prefix-cache hits in the agent's own namespace, e.g. an agent's
  second round; and the tokens of segments with ``shared: true``; a segment under selective
  recomputation adds its source-covered tokens times the fraction of their token-layers that were
  reused); ``rho_injected`` counts only
  injected (cross-agent) tokens; ``rho_later`` is ``rho`` over turns after the first.
- ``ratios``: each method's value / nonshared's value at the same point (nonshared must be among
  ``--methods``); figures show the absolute numbers with the ratio panel beneath.

Scaling sweeps (appendix style, one factor varied, the others at their base values, at rate
``--scaling-rate`` and context ``--scaling-context``): ``--agents`` (e.g. 2,4,8) and ``--rounds``
(e.g. 2,4,8).

Known limits: the server does not record output token ids of *streamed* responses, so a later
agent's ``out:<agent>`` segment is re-tokenised from text and only its common prefix with the
source's tokens can be reused (``rho`` shows how much was); ``meta_info.kvshare`` arrives as a
one-element list in streamed chunks (unwrapped here).

    python -m benchmarks.serving                       # starts a SmolLM2 server; full CPU sweep
    python -m benchmarks.serving --url http://127.0.0.1:30000 --rates 0,0.05,0.1,0.2
    python -m benchmarks.serving --quick               # a few minutes on a 2-core CPU
    python -m benchmarks.serving --agent-kind lora     # LoRA agents: the PReCache methods
    python -m benchmarks.serving --replot --out results/serving.json

Modules: ``workload`` (methods, contexts, ``PointSpec``, arrivals; the agents are
``sglang_kvshare.testing.workflows.make_roles``), ``point`` (one point's requests, streamed by
``benchmarks.client.stream_generate``), ``memory`` (``MemorySampler``), ``results`` (the frozen
dataclasses the JSON is written from: ``PointResult``, ``Point``, ``CapacityRow``, ``Part``),
``sweeps`` (the phases on one server), ``servers`` (which methods run on which server),
``report`` (tables), ``plots`` (figures), ``cli`` (``parse_args``, ``main``).
"""

from __future__ import annotations
