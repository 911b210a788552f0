"""KVCMAS fidelity benchmark: how close is each sharing method's cache and output to dense prefill?

A four-agent sequential workflow (three role agents, then the final reflecting agent, roles from
``sglang_kvshare.workflows.get_roles(dataset)``) runs over ``--tasks`` tasks of a packaged dataset
on a real server (``sglang_kvshare.launch_server``, SmolLM2-135M-Instruct, CPU, float32), once per
method. Every turn of an approximate method is paired with a SHADOW: the identical segments sent
with method ``nonshared`` under a separate shadow workflow id, so the shadow's cache is the dense,
exact cache of exactly the same prompt. The shadow is sent immediately BEFORE its real turn (it
is independent of it: other workflow, no injection, no corrector state) so that the real turn can
ask for its first-token logprobs on exactly the dense top-20 ids (``token_ids_logprob``).

Per method (see ``aggregate``):

- ``rho``: reused shared tokens / shared tokens over the non-first agents, a shared token being
  reused when its segment's mode is ``injected`` or ``corrected`` (``injected_tokens`` of the
  segment); ``rho_all`` counts the first agent too (non-chained methods may correct its ``q`` from
  the context-free reference).
- ``kv_err``: ``||C_hat - C||_F / ||C||_F`` of each reused (injected/corrected) segment, C = K and
  V of all layers of that segment in the shadow's dump, C_hat the same in the real request's dump
  (``--kvshare-dump-dir``: same workflow/agent/slot layout, same tokens at the same positions,
  checked). ``mean`` over segments and ``pooled`` (sqrt of summed squared error over summed
  squared norm); also K and V alone, and the same over ALL shared segments (dense fallbacks and
  computed segments after an approximate prefix carry propagated error).
- ``kl``: KL(dense || approx) in nats of the first generated token: support = the shadow's top-20
  ids plus one lumped "rest" outcome (1 - sum of the listed probabilities, for each side); the
  approximate side's logprobs are those of exactly these ids (``token_ids_logprob``). A lower
  bound of the full-vocabulary KL. ``top1``: same argmax first token.
- greedy agreement with the shadow (temperature 0): ``exact``: identical generated text;
  ``lead``: identical leading tokens / length of the longer output.
- ``anchor_bytes``: the largest ``meta_info.kvshare.anchor_bytes`` seen (bytes of the method's
  correction state); None when the server never reported it.
- computed tokens (sum, and per agent position; includes ``reference_tokens``), corrections
  accepted / rejected, gate reasons, and the final agent's task accuracy (``score_output``).

``nonshared`` is exact by construction; its shadows run only for the first ``--sanity-tasks``
tasks as a determinism check (expected: KL 0, exact 1).

``--tau-sweep 0.1,0.3,...`` re-runs ``--sweep-methods`` (kvcmas, kvcomm) with per-request ``tau``
on fresh workflow ids and a fresh server (fresh anchor pools), and plots rho against error.

``--agents lora`` (PReCache): agents differ only by LoRA adapter (``solver``, ``critic``, ``final``
from ``adapters/``) and take turns in one growing chat over GSM8K tasks
(``workflows.lora_conversation_roles``), so each prompt extends the previous agent's prompt and
output. Methods nonshared, baseshared, prelr_shared and rebase_shared_lp run on a server with
``--kvshare-lr-cache``; fullshared (reuse of the previous agent's full cache, value delta
included) on a plain LoRA server. Reported per method: ``prompt_reuse_later`` (1 - computed /
prompt tokens of the non-first agents), computed and ``rebuild_tokens`` (ReBaseShared's
adapter-free prefills; under LP each is charged to the next turn, so a task's last rebuild is not
counted), first-token KL and greedy agreement vs the nonshared shadow, and the KV
bytes per token against one agent's LR bytes per token (as the server reports them).

Usage (from the repository root):

    .venv/bin/python -m benchmarks.fidelity --quick                 # 4 tasks, smoke run
    .venv/bin/python -m benchmarks.fidelity                         # 40 MMLU tasks, 6 methods
    .venv/bin/python -m benchmarks.fidelity --tau-sweep 0.1,0.3,0.5,0.7,0.9 --sweep-only --tasks 20
    .venv/bin/python -m benchmarks.fidelity --agents lora          # 40 GSM8K tasks, LoRA agents

Outputs: ``--out`` (results/fidelity.json, rewritten after every task), the plot next to it
(``.png``; ``_tau.png`` for the sweep) and a markdown table on stdout.

Modules: ``options`` (methods, adapters, command line), ``records`` (the typed per-turn and per-run
records and their JSON form), ``turns`` (one shadowed workflow), ``summary`` (``aggregate``),
``runner`` (the server, the results file, the loop over tasks), ``report`` (table, plots), ``cli``.
"""
