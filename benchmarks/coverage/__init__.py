"""Selective recomputation on SmolLM2: reconstruction coverage (KVCMAS App. A.1), and the engine's
CacheBlend, DroidSpeak and RelayCaching against dense prefill at rho 0.9 and 0.8.

Part 1, coverage. The KVCMAS fidelity workflow (``benchmarks.fidelity``: four agents that differ by
system prompt, MMLU tasks, a real server) runs under ``fullshared`` over ``--profile-tasks`` +
``--tasks`` tasks; every turn is shadowed by the dense ``nonshared`` prefill of the same prompt, so
each reused shared segment of a later agent gives a pair: the reused cache ``C_i`` (the injected,
RoPE re-aligned source cache) and the exact cache ``C_j`` (K and V of all layers, from
``--kvshare-dump-dir``). The reuse error is ``E = C_i - C_j``; the coverage of a recompute subset
is the fraction of ``||E||_F^2`` it removes when its entries are replaced by exact ones (Eq. 3);
relative coverage divides by random selection of the same number of token-layers (5 seeds).
Criteria, each isolated as in the paper, at the budget ``ratio = 1 - rho``:

- ``layer`` (DroidSpeak): the contiguous layer groups (at most 2) with the largest profiled
  layer-wise deviation, every token. The profile (``DroidSpeakProfile``, relative deviation) comes
  from the profiling tasks only and is written to ``--profile-out`` for the engine;
- ``deviation`` (CacheBlend): the tokens with the largest KV deviation at layer 1 (the first layer
  whose KV depends on context, i.e. CacheBlend's check layer after recomputing layers 0-1), every
  layer;
- ``attention`` (RelayCaching): the tokens with the largest attention from the turn's last prompt
  tokens (the private suffix after the last shared segment), averaged over layers, heads and those
  queries, from a ``transformers`` forward (eager attention) of the same prompt ids; every layer.

Part 2, the engine. A server started with that profile (``--kvshare-droidspeak-profile``) runs the
same workflow on the evaluation tasks for ``fullshared`` and each method at ratio 0.1 (rho 0.9)
and 0.2 (rho 0.8); every turn shadowed as above. Reported per label (``benchmarks.fidelity``'s
``aggregate``): first-token KL and greedy agreement vs nonshared, KV error, and the realised
token-layer reuse ``1 - recomputed / shared token-layers`` of the later agents.

Usage (from the repository root):

    .venv/bin/python -m benchmarks.coverage --quick        # 1 + 2 tasks, smoke run
    .venv/bin/python -m benchmarks.coverage                # 8 profiling + 40 evaluation tasks

Outputs: ``--out`` (results/coverage.json, rewritten as it goes), the plot next to it (.png), the
profile (results/droidspeak_profile_smollm2.json) and markdown tables on stdout.

Modules: ``selection`` (the recompute selections, coverage and its summary as typed records),
``pairs`` (reused/exact cache pairs from the dumps, the profile, attention importance),
``report`` (tables, plot), ``cli``; the workflows run through ``benchmarks.fidelity.runner``.
"""
