"""What the serving benchmark sends: the methods and agent kinds, the shared contexts, one point's
spec (``PointSpec``) and its workflow arrival times. The agents themselves are
``sglang_kvshare.testing.workflows.make_roles`` (the harness that tests share)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

DEFAULT_METHODS = ("nonshared", "fullshared", "kvcmas")
# --agent-kind lora: the PReCache methods on an LR-cache server (rebase_shared_lp: a later agent's
# TTFT includes waiting for the rebuild the previous turn queued, if it has not finished)
LORA_METHODS = ("nonshared", "fullshared", "baseshared", "prelr_shared", "rebase_shared_db", "rebase_shared_lp")
# PReCache's FullShared baseline: a later LoRA agent reuses the previous agent's adapted K/V as they
# are, which needs K/V with the value deltas in them: a plain LoRA server (no LR cache), started
# after the LR-cache server's methods have run
PLAIN_LORA_METHODS = ("fullshared",)
LORA_KINDS = ("lora", "lora-random")
BASELINE = "nonshared"


def lora_server_args() -> tuple[str, ...]:
    """launch_server flags of the LR-cache server for LoRA agents, with the shipped adapters."""
    from benchmarks.fidelity.options import adapters

    paths = (f"{n}={p}" for n, p in adapters().items())
    return (
        "--enable-lora",
        "--lora-backend",
        "torch_native",
        "--max-loras-per-batch",
        "4",
        "--kvshare-lr-cache",
        "--lora-paths",
        *paths,
    )


def random_adapters(model_path: str, n: int, rank: int, out_dir: Path, seed: int = 0) -> Dict[str, str]:
    """``n`` PEFT LoRA adapters ``a0..`` (q_proj, v_proj, rank ``rank``, alpha 2 x rank) with random
    weights for the model: for timing any number of agents and ranks (their outputs mean
    nothing). Returns name -> directory."""
    from sglang_kvshare.testing.tiny_model import build_tiny_adapter

    # B small enough that greedy text stays text-like
    return {
        f"a{i}": build_tiny_adapter(model_path, out_dir / f"a{i}", seed + i, rank=rank, b_std=0.02) for i in range(n)
    }


_NOTES: List[str] = []


def _notes() -> List[str]:
    """Real notes: every MMLU question (with options) and GSM8K problem of the packaged data."""
    if not _NOTES:
        from benchmarks.datasets import load_tasks

        _NOTES.extend(t.question.replace("Question: ", "", 1) for t in load_tasks("mmlu") + load_tasks("gsm8k"))
    return _NOTES


def make_context(tok, n_tokens: int, tag: str) -> str:
    """A shared context of ``n_tokens`` tokens (as the server tokenises it, rarely one more), unique
    per ``tag``: numbered notes drawn from the packaged MMLU and GSM8K items (seeded by ``tag``),
    then a question about one of them."""
    notes = _notes()
    rng = random.Random(f"context:{tag}")
    head, tail = f"Case {tag}. Notes:\n", "\nQuestion: which note above is the hardest, and why?"
    budget = n_tokens - len(tok.encode(head + tail, add_special_tokens=False))
    parts, used = [], 0
    while used < budget + 16:
        note = f"{len(parts) + 1}. {notes[rng.randrange(len(notes))].strip()}\n"
        parts.append(note)
        used += len(tok.encode(note, add_special_tokens=False))
    ids = tok.encode("".join(parts), add_special_tokens=False)
    cut = max(1, budget)
    while len(tok.encode(text := head + tok.decode(ids[:cut]) + tail, add_special_tokens=False)) < n_tokens:
        cut += 1  # a token can merge across the seams: grow until the count is reached
    return text


@dataclass(frozen=True)
class PointSpec:
    """One method's run at one point: ``workflows`` workflows of ``agents`` agents over ``rounds``
    rounds on ``context``-token contexts, arriving at ``rate`` wf/s (Poisson, seeded by ``seed``;
    0: one after another), each agent output ``output_len`` tokens."""

    context: int
    rate: float
    method: str
    agents: int
    rounds: int
    workflows: int
    output_len: int
    seed: int
    kind: str = "prompt"
    prefix: str = ""
    concurrency: int = 0  # > 0: closed loop, this many workflows in flight, no arrival times


def turns_of(agents: int, rounds: int) -> int:
    """Requests of one workflow: every task agent each round, then the final agent once."""
    return (agents - 1) * rounds + 1


def arrival_offsets(rate: float, n: int, seed: int) -> Optional[List[float]]:
    """Poisson arrival times (s after start; the first at 0) or None for single stream (rate 0)."""
    if rate <= 0:
        return None
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out
