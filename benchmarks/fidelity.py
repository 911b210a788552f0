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
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import platform
import shutil
import sys
import tempfile
import time
import uuid
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from tqdm import tqdm

from benchmarks.fidelity_metrics import (
    REUSED_MODES,
    common_prefix,
    first_token_requested,
    first_token_top,
    kl_lumped,
    kl_topk_union,
    kv_error,
    leading_agreement,
    load_dump,
    mean,
    output_ids,
    pooled,
    reuse_counts,
    safe_name,
)
from sglang_kvshare.methods import get_method, method_variant
from benchmarks.datasets import load_tasks
from benchmarks.scoring import score_output
from sglang_kvshare.workflows import get_roles, http_sender, lora_conversation_roles, run_task

MAIN_METHODS = ("nonshared", "fullshared", "kvcmas", "kvcmas_nonchained", "kvcomm", "graphflow")
# --agents lora: agents that differ by LoRA adapter (PReCache); fullshared runs on a server
# without the LR cache (it reuses the previous agent's full cache, value delta included)
LORA_METHODS = ("nonshared", "fullshared", "baseshared", "prelr_shared", "rebase_shared_lp")
# rebase_shared_db builds the same cache as rebase_shared_lp (tests/integration/test_precache_engine.py)
RECOMPUTE_METHODS = ("cacheblend", "droidspeak", "relaycaching")  # see benchmarks.coverage
KNOWN_METHODS = MAIN_METHODS + ("kvcmas_plus",) + LORA_METHODS[2:] + ("rebase_shared_db",) + RECOMPUTE_METHODS
REPO = Path(__file__).resolve().parent.parent
TAU_METHODS = {"kvcmas", "kvcmas_nonchained", "kvcmas_plus", "kvcomm"}  # graphflow has no gate
TOPOLOGY = "sequential"
TOP_K = 20


def adapters(targets: str = "qv") -> dict:
    """The shipped adapters of the LoRA roles (``lora_conversation_roles``) on ``targets``
    (``qv`` or ``qkvo``), by adapter name."""
    names = [r.lora_path for r in lora_conversation_roles().roles]
    return {name: REPO / "adapters" / f"smollm2-{name}-{targets}-r8" for name in names}


# ----------------------------------------------------------------------------- one turn


class ShadowedSender:
    """A ``send`` for ``run_task``: per turn, the dense shadow (optional), then the real request,
    both asking for first-token logprobs. Records raw replies in ``self.turns``."""

    def __init__(self, send, method: str, shadow_workflow: str, tau: Optional[float], shadow: bool,
                 recompute_ratio: Optional[float] = None):
        self.send = send
        self.method = method
        self.shadow_workflow = shadow_workflow
        self.tau = tau
        self.shadow = shadow
        self.recompute_ratio = recompute_ratio
        self.turns: List[Dict[str, Any]] = []

    def __call__(self, payload: Dict[str, Any]) -> Dict[str, Any]:
        logprob = {"return_logprob": True, "top_logprobs_num": TOP_K, "logprob_start_len": -1}
        turn: Dict[str, Any] = {"payload": payload}
        dense_ids: List[int] = []
        if self.shadow:
            sp = copy.deepcopy(payload)
            sp["kvshare"]["workflow"] = self.shadow_workflow
            sp["kvshare"]["method"] = "nonshared"
            sp["kvshare"].pop("tau", None)
            sp.update(logprob)
            t0 = time.perf_counter()
            turn["shadow"] = self.send(sp)
            turn["shadow_latency_s"] = time.perf_counter() - t0
            dense_ids = sorted(first_token_top(turn["shadow"]))
        real = copy.deepcopy(payload)
        if self.tau is not None and method_variant(self.method)[0] in TAU_METHODS:
            real["kvshare"]["tau"] = self.tau
        if self.recompute_ratio is not None:
            real["kvshare"]["recompute_ratio"] = self.recompute_ratio
        real.update(logprob)
        if dense_ids:
            real["token_ids_logprob"] = dense_ids
        t0 = time.perf_counter()
        turn["real"] = self.send(real)
        turn["latency_s"] = time.perf_counter() - t0
        self.turns.append(turn)
        return turn["real"]


def _wait_file(path: Path, timeout: float = 15.0) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if path.exists():
            return True
        time.sleep(0.1)
    return path.exists()


def _segment_shape(kvshare: Dict[str, Any]) -> List[int]:
    return [int(s.get("tokens", 0)) for s in kvshare.get("segments") or []]


def analyse_turn(
    position: int, turn: Dict[str, Any], workflow: str, shadow_workflow: str, dump_root: Optional[Path]
) -> Dict[str, Any]:
    """The measurements of one agent turn (and its shadow, when there is one)."""
    real = turn["real"]
    meta = real.get("meta_info") or {}
    kv = meta.get("kvshare") or {}
    agent = turn["payload"]["kvshare"]["agent"]
    reused, shared = reuse_counts(kv)
    rec: Dict[str, Any] = {
        "position": position,
        "agent": agent,
        "payload_kvshare": turn["payload"]["kvshare"],  # what was sent (segments' text)
        "text": real.get("text", ""),
        "output_ids": output_ids(real),
        "latency_s": round(turn["latency_s"], 3),
        "prompt_tokens": kv.get("prompt_tokens"),
        "computed_tokens": kv.get("computed_tokens"),
        "reference_tokens": kv.get("reference_tokens", 0),
        "reused_tokens": kv.get("reused_tokens"),
        "injected_tokens": kv.get("injected_tokens"),
        "corrections_accepted": kv.get("corrections_accepted", 0),
        "corrections_rejected": kv.get("corrections_rejected", 0),
        "anchor_bytes": kv.get("anchor_bytes"),
        "rebuild_tokens": kv.get("rebuild_tokens", 0),
        "kv_bytes_per_token": kv.get("kv_bytes_per_token"),
        "lr_bytes_per_token_per_agent": kv.get("lr_bytes_per_token_per_agent"),
        "shared_tokens": shared,
        "shared_reused": reused,
        "segments": [
            {k: s.get(k) for k in ("slot", "tokens", "mode", "injected_tokens", "source_agent",
                                   "gate", "entropy", "anchors", "corrected_rows", "recompute_ratio",
                                   "source_tokens", "token_layers", "recomputed_token_layers",
                                   "layer_groups", "reason", "kept_as", "leaf_rank", "leaf_bytes") if k in s}
            for s in kv.get("segments") or [] if s.get("shared")
        ],
    }
    if "shadow" not in turn:
        return rec
    shadow = turn["shadow"]
    skv = (shadow.get("meta_info") or {}).get("kvshare") or {}
    rec["shadow_latency_s"] = round(turn["shadow_latency_s"], 3)
    rec["shadow_text"] = shadow.get("text", "")
    rec["prompt_match"] = (
        skv.get("prompt_tokens") == kv.get("prompt_tokens") and _segment_shape(skv) == _segment_shape(kv)
    )
    # first-token distribution
    p = first_token_top(shadow)
    q_req = first_token_requested(real)
    q_top = first_token_top(real)
    kl = kl_lumped(p, q_req)
    rec["kl_method"] = "token_ids_logprob"
    if kl is None:
        kl, rec["kl_method"] = kl_topk_union(p, q_top), "topk_union_bound"
    rec["kl"] = kl
    if p and q_top:
        rec["top1_agree"] = max(p, key=p.get) == max(q_top, key=q_top.get)
        rec["dense_rest_mass"] = max(1.0 - sum(math.exp(v) for v in p.values()), 0.0)
    # greedy agreement
    a_ids, d_ids = rec["output_ids"], output_ids(shadow)
    rec["exact_match"] = rec["text"] == rec["shadow_text"]
    rec["lead_agree"] = leading_agreement(a_ids, d_ids)
    rec["common_prefix"] = common_prefix(a_ids, d_ids)
    # KV error of every shared segment (reused ones and the rest)
    if dump_root is not None:
        errs = []
        for seg in kv.get("segments") or []:
            if not seg.get("shared"):
                continue
            slot = seg["slot"]
            fa = dump_root / safe_name(workflow) / safe_name(agent) / f"{safe_name(slot)}.pt"
            fd = dump_root / safe_name(shadow_workflow) / safe_name(agent) / f"{safe_name(slot)}.pt"
            entry: Dict[str, Any] = {"slot": slot, "mode": seg.get("mode"), "tokens": seg.get("tokens")}
            if not (_wait_file(fa) and _wait_file(fd)):
                entry["missing"] = True
            else:
                e = kv_error(load_dump(fa), load_dump(fd))
                if e is None:
                    entry["mismatch"] = True
                else:
                    entry.update({k: e[k] for k in ("rel", "k_rel", "v_rel", "diff2", "ref2",
                                                    "k_diff2", "k_ref2", "v_diff2", "v_ref2")})
            errs.append(entry)
        rec["seg_errors"] = errs
    return rec


# ----------------------------------------------------------------------------- one run


def run_one(
    send, task, roles, label: str, method: str, tau: Optional[float], tag: str, max_new_tokens: int,
    shadow: bool, dump_root: Optional[Path], keep_dumps: bool, recompute_ratio: Optional[float] = None,
) -> Dict[str, Any]:
    workflow = f"fid:{tag}:{label}:{task.id}"
    shadow_workflow = f"fidshadow:{tag}:{label}:{task.id}"
    sender = ShadowedSender(send, method, shadow_workflow, tau, shadow, recompute_ratio)
    t0 = time.perf_counter()
    record = run_task(task, roles, TOPOLOGY, method, sender, max_new_tokens, workflow_id=workflow,
                      score_fn=score_output)
    wall = time.perf_counter() - t0
    turns = [analyse_turn(i, t, workflow, shadow_workflow, dump_root) for i, t in enumerate(sender.turns)]
    if dump_root is not None and not keep_dumps:
        for wf in (workflow, shadow_workflow):
            shutil.rmtree(dump_root / safe_name(wf), ignore_errors=True)
    return {
        "task_id": task.id,
        "method": method,
        "tau": tau,
        "recompute_ratio": recompute_ratio,
        "label": label,
        "workflow": workflow,
        "shadowed": shadow,
        "reference": task.reference,
        "final_output": record.final_output,
        "correct": bool(record.score.correct),
        "predicted": record.score.predicted,
        "wall_s": round(wall, 2),
        "turns": turns,
    }


# ----------------------------------------------------------------------------- aggregation


def _errs(runs, positions=None, modes=REUSED_MODES, kind=None):
    """Segment errors of ``runs``; ``kind``: "q" (the question slot) or "out" (agent outputs)."""
    out = []
    for r in runs:
        for t in r["turns"]:
            if positions is not None and t["position"] not in positions:
                continue
            for e in t.get("seg_errors") or []:
                if "rel" not in e or (modes is not None and e["mode"] not in modes):
                    continue
                if kind is not None and (e["slot"] == "q") != (kind == "q"):
                    continue
                out.append(e)
    return out


def _r(x, nd=4):
    return None if x is None else round(x, nd)


def aggregate(runs: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Per-method summary of ``run_one`` records of one label (method[@tau])."""
    ok = [r for r in runs if "error" not in r]
    turns = [t for r in ok for t in r["turns"]]
    later = [t for t in turns if t["position"] > 0]
    positions = sorted({t["position"] for t in turns})
    shadowed = [t for t in turns if "kl" in t]
    s_later = [t for t in shadowed if t["position"] > 0]
    reused = _errs(ok)
    all_shared = _errs(ok, modes=None)
    gates = Counter(s.get("gate") for t in turns for s in t["segments"] if s.get("gate"))
    modes = Counter(s.get("mode") for t in later for s in t["segments"])
    anchor = [t["anchor_bytes"] for t in turns if t.get("anchor_bytes") is not None]

    def ratio(ts):
        tot = sum(t["shared_tokens"] for t in ts)
        return _r(sum(t["shared_reused"] for t in ts) / tot) if tot else None

    def entropies(kind):
        """Gate entropies of one slot kind (``q``: the question, ``out``: agent outputs)."""
        vals = sorted(s["entropy"] for t in later for s in t["segments"]
                      if s.get("entropy") is not None and (s["slot"] == "q") == (kind == "q"))
        if not vals:
            return None
        q = lambda f: vals[min(len(vals) - 1, int(f * len(vals)))]  # noqa: E731
        return {"n": len(vals), "p10": _r(q(0.1)), "p50": _r(q(0.5)), "p90": _r(q(0.9)),
                "max": _r(vals[-1]), "distinct": len(set(vals))}

    return {
        "tasks": len(ok),
        "failed_tasks": len(runs) - len(ok),
        "turns": len(turns),
        "shadowed_turns": len(shadowed),
        "rho": ratio(later),
        "rho_all": ratio(turns),
        "rho_by_position": {p: ratio([t for t in turns if t["position"] == p]) for p in positions},
        "reused_segments": len(reused),
        "kv_err_mean": _r(mean(e["rel"] for e in reused)),
        "kv_err_pooled": _r(pooled(reused)),
        "kv_err_k_pooled": _r(pooled(reused, "k_")),
        "kv_err_v_pooled": _r(pooled(reused, "v_")),
        "kv_err_max": _r(max((e["rel"] for e in reused), default=None)),
        # the same split by slot kind: the question (long, context-only) vs agent outputs (short)
        "kv_err_q_pooled": _r(pooled(_errs(ok, kind="q"))),
        "kv_err_out_pooled": _r(pooled(_errs(ok, kind="out"))),
        "reused_segments_q": len(_errs(ok, kind="q")),
        "reused_segments_out": len(_errs(ok, kind="out")),
        "kv_err_all_shared_mean": _r(mean(e["rel"] for e in all_shared)),
        "kv_err_all_shared_pooled": _r(pooled(all_shared)),
        "kv_err_by_position": {p: _r(pooled(_errs(ok, {p}))) for p in positions},
        "dump_missing_or_mismatch": sum(
            1 for t in turns for e in t.get("seg_errors") or [] if "missing" in e or "mismatch" in e
        ),
        "prompt_mismatch_turns": sum(1 for t in shadowed if not t.get("prompt_match", True)),
        "kl_mean": _r(mean(t["kl"] for t in shadowed), 5),
        "kl_mean_later": _r(mean(t["kl"] for t in s_later), 5),
        "kl_max": _r(max((t["kl"] for t in shadowed if t["kl"] is not None), default=None), 5),
        "kl_by_position": {p: _r(mean(t["kl"] for t in shadowed if t["position"] == p), 5) for p in positions},
        "kl_methods": dict(Counter(t.get("kl_method") for t in shadowed)),
        "dense_rest_mass_mean": _r(mean(t.get("dense_rest_mass") for t in shadowed), 5),
        "top1_agree": _r(mean(float(t["top1_agree"]) for t in shadowed if "top1_agree" in t)),
        "exact_match": _r(mean(float(t["exact_match"]) for t in shadowed)),
        "exact_match_later": _r(mean(float(t["exact_match"]) for t in s_later)),
        "lead_agree": _r(mean(t["lead_agree"] for t in shadowed)),
        "lead_agree_later": _r(mean(t["lead_agree"] for t in s_later)),
        "anchor_bytes": max(anchor) if anchor else None,
        "anchor_bytes_reported_turns": len(anchor),
        "computed_tokens": sum(t["computed_tokens"] or 0 for t in turns),
        # prompt tokens not computed by the non-first agents (cached prefix, injected, corrected)
        "prompt_reuse_later": _r(1.0 - sum(t["computed_tokens"] or 0 for t in later)
                                 / max(1, sum(t["prompt_tokens"] or 0 for t in later))),
        "rebuild_tokens": sum(t.get("rebuild_tokens") or 0 for t in turns),
        # selective recomputation: token-layers of the reused (source-covered) shared tokens
        "recomputed_token_layers": sum(s.get("recomputed_token_layers") or 0 for t in later for s in t["segments"]),
        "shared_token_layers": sum(s.get("token_layers") or 0 for t in later for s in t["segments"]),
        "kv_bytes_per_token": max((t.get("kv_bytes_per_token") or 0 for t in turns), default=0) or None,
        "lr_bytes_per_token_per_agent": max((t.get("lr_bytes_per_token_per_agent") or 0 for t in turns),
                                            default=0) or None,
        "prompt_tokens": sum(t["prompt_tokens"] or 0 for t in turns),
        "reference_tokens": sum(t["reference_tokens"] or 0 for t in turns),
        "computed_by_position": {p: sum(t["computed_tokens"] or 0 for t in turns if t["position"] == p) for p in positions},
        "corrections_accepted": sum(t["corrections_accepted"] for t in turns),
        "corrections_rejected": sum(t["corrections_rejected"] for t in turns),
        "gates": dict(gates),
        "entropy_q": entropies("q"),
        "entropy_out": entropies("out"),
        "modes_later": dict(modes),
        "accuracy": _r(mean(float(r["correct"]) for r in ok)),
        "mean_turn_latency_s": _r(mean(t["latency_s"] for t in turns), 3),
    }


LORA_COLUMNS = [
    ("method", None), ("prompt reuse", "prompt_reuse_later"), ("KL mean", "kl_mean"),
        ("KL later", "kl_mean_later"), ("top1", "top1_agree"),
    ("exact", "exact_match"), ("lead", "lead_agree"), ("computed", "computed_tokens"),
    ("rebuild", "rebuild_tokens"), ("KV B/token", "kv_bytes_per_token"),
    ("LR B/token/agent", "lr_bytes_per_token_per_agent"), ("accuracy", "accuracy"), ("tasks", "tasks"),
]


def markdown_table(summary: Dict[str, Dict[str, Any]], lora: bool = False) -> str:
    cols = LORA_COLUMNS if lora else [
        ("method", None), ("rho", "rho"), ("KV err mean", "kv_err_mean"), ("KV err pooled", "kv_err_pooled"),
        ("KV err all-shared", "kv_err_all_shared_pooled"), ("KL mean", "kl_mean"),
        ("KL later", "kl_mean_later"), ("top1", "top1_agree"),
        ("exact", "exact_match"), ("lead", "lead_agree"), ("computed", "computed_tokens"),
        ("acc/rej", None), ("anchor bytes", "anchor_bytes"), ("accuracy", "accuracy"), ("tasks", "tasks"),
    ]
    cols = list(cols)
    lines = ["| " + " | ".join(c for c, _ in cols) + " |", "|" + "---|" * len(cols)]
    for label, s in summary.items():
        row = []
        for name, key in cols:
            if name == "method":
                row.append(label)
            elif name == "acc/rej":
                row.append(f"{s['corrections_accepted']}/{s['corrections_rejected']}")
            else:
                v = s.get(key)
                row.append("-" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v)))
        lines.append("| " + " | ".join(row) + " |")
    gated = {label: s for label, s in summary.items() if s.get("entropy_q") or s.get("entropy_out")}
    if gated and not lora:
        lines += ["", "gate entropy of the later agents' segments by slot kind (p10 / p50 / p90, distinct "
                  "values of n):", "", "| method | question slot | output slots |", "|---|---|---|"]
        for label, s in gated.items():
            cell = lambda e: "-" if not e else f"{e['p10']:.3g} / {e['p50']:.3g} / {e['p90']:.3g} ({e['distinct']} of {e['n']})"  # noqa: E731
            lines.append(f"| {label} | {cell(s.get('entropy_q'))} | {cell(s.get('entropy_out'))} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- plots


def plot_methods(summary: Dict[str, Dict[str, Any]], path: Path, lora: bool = False) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(summary)
    x = range(len(labels))
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 1.1 * len(labels) * 2), 4.8))
    panels = [
        ("computed_tokens", None, "computed prompt tokens, all turns") if lora else
        ("kv_err_pooled", "kv_err_mean", "normalized KV error of reused segments"),
        ("kl_mean", None, "KL(dense || approx), first token (nats)"),
    ]
    for ax, (key, key2, title) in zip(axes, panels):
        vals = [summary[m].get(key) or 0.0 for m in labels]
        bars = ax.bar(x, vals, color="tab:blue", label="pooled" if key2 else "mean")
        extra = [summary[m].get(key2) or 0.0 for m in labels] if key2 else []
        if key2:
            ax.scatter(x, extra, color="tab:red", zorder=3, label="mean over segments")
            ax.legend(fontsize=8)
        top = max(vals + extra + [1e-9])
        for b, m in zip(bars, labels):
            rho = summary[m].get("prompt_reuse_later" if lora else "rho")
            name = "reuse" if lora else "rho"
            ax.text(b.get_x() + b.get_width() / 2, b.get_height() + 0.02 * top,
                    f"{name}=-" if rho is None else f"{name}={rho:.2f}", ha="center", fontsize=8)
        ax.set_xticks(list(x))
        ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.set_ylim(0, top * 1.18)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_sweep(sweep: Dict[str, Dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_method: Dict[str, List] = defaultdict(list)
    for label, s in sweep.items():
        method, tau = label.split("@")
        by_method[method].append((float(tau), s))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, key, title in ((axes[0], "kv_err_all_shared_pooled",
                            "pooled KV error: all shared segments (solid), reused only (dashed)"),
                           (axes[1], "kl_mean", "first-token KL(dense || approx)")):
        for method, pts in sorted(by_method.items()):
            pts.sort()
            xs = [s.get("rho") or 0.0 for _, s in pts]
            ys = [s.get(key) or 0.0 for _, s in pts]
            line, = ax.plot(xs, ys, "o-", label=method)
            if key == "kv_err_all_shared_pooled":
                ax.plot(xs, [s.get("kv_err_pooled") or 0.0 for _, s in pts], "x--", color=line.get_color())
            for (tau, _), xx, yy in zip(pts, xs, ys):
                ax.annotate(f"tau={tau:g}", (xx, yy), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set_xlabel("reuse ratio rho (non-first agents)")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------- driver


class Backend:
    """The server: started here (with a dump dir) or attached to (``--server-url``)."""

    def __init__(self, args, workdir: Path, name: str, lr_cache: bool = False, extra_flags: Sequence[str] = ()):
        self.server = None
        if args.server_url:
            self.url = args.server_url
            self.dump_root = Path(args.dump_dir) if args.dump_dir else None
            return
        from sglang_kvshare.assets import ensure_default_model
        from sglang_kvshare.testing.server import kvshare_server

        self.dump_root = workdir / f"dumps-{name}"
        self.log_path = workdir / f"server-{name}.log"
        flags = ["--kvshare-dump-dir", str(self.dump_root), "--max-total-tokens", str(args.max_total_tokens)]
        if args.agents == "lora":
            flags += ["--enable-lora", "--lora-backend", "torch_native", "--max-loras-per-batch", "4",
                      "--lora-paths", *[f"{n}={p}" for n, p in adapters(args.adapter_targets).items()]]
        if lr_cache:
            flags.append("--kvshare-lr-cache")
        flags += list(extra_flags)
        print(f"starting server ({name}), log {self.log_path}", flush=True)
        t0 = time.time()
        self.server = kvshare_server(str(ensure_default_model()), self.log_path, *flags,
                                     timeout=args.server_timeout)
        self.url = self.server.url
        print(f"server up at {self.url} in {time.time() - t0:.0f}s", flush=True)

    def alive(self) -> bool:
        return self.server is None or self.server.proc.poll() is None

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()


def measured_and_warmup_tasks(dataset: str, n: int, warmup: int, seed: int = 0):
    """(the ``n`` measured tasks, ``warmup`` other tasks): the measured ones are those of a run
    without warm-up (``load_tasks`` keeps a smaller n a subset of a larger one)."""
    tasks = load_tasks(dataset, n, seed=seed)
    measured = {t.id for t in tasks}
    rest = [t for t in load_tasks(dataset, n + warmup, seed=seed) if t.id not in measured]
    return tasks, rest[:warmup]


def warm_up(args, backend: Backend, tasks, roles, plan: Sequence[tuple], tag: str) -> int:
    """Run the correction methods of ``plan`` over ``tasks`` (distinct from the measured ones),
    unshadowed and unrecorded, so the measured tasks meet warm anchor pools and a settled online
    tau, as a long-running server would; returns the workflows run."""
    send = http_sender(backend.url, timeout=args.request_timeout)
    todo = [p for p in plan if get_method(method_variant(p[1])[0]).corrector is not None]
    bar = tqdm(total=len(tasks) * len(todo), desc="warm-up", unit="wf", dynamic_ncols=True)
    for task in tasks:
        for label, method, tau, *ratio in todo:
            bar.set_postfix_str(f"{label} {task.id}")
            run_one(send, task, roles, f"warmup-{label}", method, tau, tag, args.max_new_tokens, False,
                    backend.dump_root, False, *ratio)
            bar.update(1)
    bar.close()
    return len(tasks) * len(todo)


def run_plan(args, backend: Backend, tasks, roles, plan: Sequence[tuple], tag: str,
             results: Dict[str, Any], section: str, save, warmup_tasks=()) -> None:
    """Task-major loop over the (label, method, tau[, recompute_ratio]) of ``plan``, after the
    correction methods' warm-up over ``warmup_tasks``; saves after every task."""
    if warmup_tasks:
        results["config"][section + "_warmup_workflows"] = warm_up(args, backend, warmup_tasks, roles, plan, tag)
    send = http_sender(backend.url, timeout=args.request_timeout)
    runs: Dict[str, List] = results.setdefault(section + "_runs", {})
    bar = tqdm(total=len(tasks) * len(plan), desc=section, unit="wf", dynamic_ncols=True)
    for ti, task in enumerate(tasks):
        for label, method, tau, *ratio in plan:
            shadow = method != "nonshared" or ti < args.sanity_tasks
            bar.set_postfix_str(f"{label} {task.id}")
            try:
                rec = run_one(send, task, roles, label, method, tau, tag, args.max_new_tokens, shadow,
                              backend.dump_root, args.keep_dumps, *ratio)
            except Exception as e:  # noqa: BLE001 - recorded, the run goes on
                rec = {"task_id": task.id, "method": method, "tau": tau, "label": label, "error": repr(e)}
                tqdm.write(f"[{label} {task.id}] failed: {e!r}")
                if not backend.alive():
                    raise RuntimeError("the server died; see its log") from e
            runs.setdefault(label, []).append(rec)
            bar.update(1)
        results[section] = {label: aggregate(rs) for label, rs in runs.items()}
        save()
    bar.close()


def _git_head() -> Optional[str]:
    """The repository's HEAD commit (and whether the tree is dirty), for the record."""
    import subprocess

    try:
        root = Path(__file__).resolve().parent.parent
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return head + ("+dirty" if dirty else "") if head else None
    except (OSError, subprocess.SubprocessError):
        return None


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--agents", choices=("prompt", "lora"), default="prompt",
                    help="prompt: agents differ by system prompt (KVCMAS); lora: by LoRA adapter "
                         "(PReCache; the adapters in adapters/, one growing chat)")
    ap.add_argument("--adapter-targets", choices=("qv", "qkvo"), default="qv",
                    help="with --agents lora: the shipped role adapters on q/v or on q/k/v/o")
    ap.add_argument("--dataset", default=None, help="mmlu | gsm8k | gpqa | humaneval (default mmlu; "
                    "gsm8k with --agents lora)")
    ap.add_argument("--tasks", type=int, default=40, help="tasks (default 40)")
    ap.add_argument("--quick", action="store_true", help="4 tasks, smoke run")
    ap.add_argument("--warmup-tasks", type=int, default=0,
                    help="tasks (distinct from the measured ones) that the correction methods run "
                         "first, unrecorded, so the measured tasks meet warm anchor pools")
    ap.add_argument("--seed", type=int, default=0, help="task sampling seed of load_tasks")
    ap.add_argument("--methods", default=None,
                    help=f"comma list of {', '.join(KNOWN_METHODS)} (default: {', '.join(MAIN_METHODS)}; "
                         f"with --agents lora: {', '.join(LORA_METHODS)})")
    ap.add_argument("--tau", type=float, default=None,
                    help="a fixed gate threshold of the main run, sent per request to the gated methods "
                         "(default: the server's own, tuned online to --kvshare-target-rho)")
    ap.add_argument("--tau-sweep", default="", help="e.g. 0.1,0.3,0.5,0.7,0.9")
    ap.add_argument("--sweep-methods", default="kvcmas,kvcomm")
    ap.add_argument("--sweep-tasks", type=int, default=None, help="tasks of the sweep (default --tasks)")
    ap.add_argument("--sweep-only", action="store_true", help="skip the main run")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--sanity-tasks", type=int, default=2,
                    help="tasks on which nonshared is shadowed too (determinism check)")
    ap.add_argument("--out", default=None, help="JSON path (default results/fidelity.json, "
                    "results/fidelity_tau.json with --sweep-only)")
    ap.add_argument("--max-total-tokens", type=int, default=32768)
    ap.add_argument("--server-url", default=None, help="use a running server instead of starting one")
    ap.add_argument("--server-per-method", action="store_true",
                    help="a fresh server for each method of the main run (fallback variants of one method "
                         "share anchor pools and the gate threshold on one server)")
    ap.add_argument("--dump-dir", default=None, help="its --kvshare-dump-dir (with --server-url)")
    ap.add_argument("--workdir", default=None, help="server logs and dumps (default: a temp dir)")
    ap.add_argument("--keep-dumps", action="store_true")
    ap.add_argument("--droidspeak-profile", default=None,
                    help="--kvshare-droidspeak-profile of the started servers (see benchmarks.coverage)")
    ap.add_argument("--server-timeout", type=float, default=900)
    ap.add_argument("--request-timeout", type=float, default=900)
    ap.add_argument("--from-json", default=None,
                    help="no server: recompute the summaries, table and plots of an earlier run's "
                         "JSON from its raw records (written back to --out, default: that file)")
    args = ap.parse_args(argv)
    if args.quick:
        args.tasks = min(args.tasks, 4)
    if args.warmup_tasks < 0:
        ap.error("--warmup-tasks must be >= 0")
    lora = args.agents == "lora"
    args.dataset = args.dataset or ("gsm8k" if lora else "mmlu")
    if args.methods is None:
        args.methods = ",".join(LORA_METHODS if lora else MAIN_METHODS)
    methods = [m for m in args.methods.split(",") if m]
    for m in methods + args.sweep_methods.split(","):
        try:
            base = method_variant(m)[0] if m else m
        except KeyError as e:
            ap.error(e.args[0])
        if m and base not in KNOWN_METHODS:
            ap.error(f"unknown method {m!r}")
    args.method_list = methods
    args.taus = [float(t) for t in args.tau_sweep.split(",") if t]
    if any(not 0.0 <= t <= 1.0 for t in args.taus + ([args.tau] if args.tau is not None else [])):
        ap.error("tau must be in [0, 1]")
    if args.server_per_method and (lora or args.server_url):
        ap.error("--server-per-method starts its own servers, for prompt agents: drop --server-url / --agents lora")
    if lora and args.taus:
        ap.error("--tau-sweep is for the gated prompt-agent methods, not --agents lora")
    if args.sweep_only and not args.taus:
        ap.error("--sweep-only needs --tau-sweep")
    if args.out is None:
        if args.from_json:
            args.out = args.from_json
        else:
            args.out = ("results/fidelity_tau.json" if args.sweep_only
                        else "results/fidelity_lora.json" if lora else "results/fidelity.json")
    return args


def write_results(results: Dict[str, Any], out: Path) -> None:
    """Write the results JSON atomically (a reader never sees half a file)."""
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(results, indent=1, default=str))
    tmp.replace(out)


def reaggregate(src: Path, out: Path) -> None:
    """Summaries, table and plots recomputed from the ``*_runs`` raw records of ``src``."""
    results = json.loads(src.read_text())
    for section in ("main", "tau_sweep"):
        runs = results.get(section + "_runs")
        if not runs:
            continue
        results[section] = {label: aggregate(rs) for label, rs in runs.items()}
        lora = results.get("config", {}).get("agents_kind") == "lora"
        print(f"\n{section} ({src}):\n" + markdown_table(results[section], lora=lora) + "\n")
        if section == "main":
            plot_methods(results[section], out.with_suffix(".png"), lora=lora)
        else:
            plot_sweep(results[section], out.with_name(out.stem.replace("_tau", "") + "_tau.png"))
    write_results(results, out)


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.from_json:
        reaggregate(Path(args.from_json), out)
        return 0
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="kvshare-fidelity-"))
    workdir.mkdir(parents=True, exist_ok=True)
    tasks, warmup_tasks = measured_and_warmup_tasks(args.dataset, args.tasks, args.warmup_tasks, args.seed)
    lora = args.agents == "lora"
    roles = lora_conversation_roles(args.dataset) if lora else get_roles(args.dataset)
    tag = uuid.uuid4().hex[:8]
    results: Dict[str, Any] = {
        "config": {
            "agents_kind": args.agents, "adapter_targets": args.adapter_targets if args.agents == "lora" else None,
            "dataset": args.dataset, "tasks": [t.id for t in tasks], "topology": TOPOLOGY,
            "agents": [r.name for r in roles.roles], "methods": args.method_list,
            "warmup_tasks": [t.id for t in warmup_tasks], "tau": args.tau,
            "tau_sweep": args.taus, "sweep_methods": args.sweep_methods.split(","),
            "max_new_tokens": args.max_new_tokens, "top_k": TOP_K, "temperature": 0.0,
            "max_total_tokens": args.max_total_tokens, "run_tag": tag, "workdir": str(workdir),
            "argv": sys.argv[1:], "host": platform.node(), "git_head": _git_head(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        },
        "notes": __doc__.split("Usage")[0].strip(),
    }

    def save():
        results["config"]["updated"] = time.strftime("%Y-%m-%d %H:%M:%S")
        write_results(results, out)

    print(f"fidelity: {len(tasks)} {args.dataset} tasks, results -> {out}, workdir {workdir}", flush=True)
    if not args.sweep_only and args.method_list:
        # labels of the main run are the plain method names; its tau (None: the server's online tau) is in the config
        plan = [(m, m, args.tau if method_variant(m)[0] in TAU_METHODS else None) for m in args.method_list]
        groups = [(f"main-{p[0]}", False, [p]) for p in plan] if args.server_per_method \
            else [("main", False, plan)]
        if lora:  # the LR cache methods (and their nonshared reference) on an LR-cache server
            lr = [p for p in plan if p[1] == "nonshared" or get_method(method_variant(p[1])[0]).lr_sharing]
            groups = [("main-lr", True, lr), ("main-full", False, [p for p in plan if p not in lr])]
        for name, lr_cache, group in groups:
            if not group:
                continue
            profile = ["--kvshare-droidspeak-profile", str(Path(args.droidspeak_profile).resolve())] \
                if args.droidspeak_profile else []
            backend = Backend(args, workdir, name, lr_cache=lr_cache, extra_flags=profile)
            try:
                run_plan(args, backend, tasks, roles, group, tag, results, "main", save, warmup_tasks)
            finally:
                backend.stop()
        summary = results["main"]
        plot_methods(summary, out.with_suffix(".png"), lora=lora)
        print("\n" + markdown_table(summary, lora=lora) + "\n", flush=True)
        print(f"plot: {out.with_suffix('.png')}", flush=True)
    if args.taus:
        sweep_tasks = tasks[: args.sweep_tasks] if args.sweep_tasks else tasks
        backend = Backend(args, workdir, "sweep")  # fresh anchor pools
        try:
            plan = [(f"{m}@{t:g}", m, t) for t in args.taus for m in args.sweep_methods.split(",")]
            run_plan(args, backend, sweep_tasks, roles, plan, tag, results, "tau_sweep", save)
        finally:
            backend.stop()
        png = out.with_name(out.stem.replace("_tau", "") + "_tau.png")
        plot_sweep(results["tau_sweep"], png)
        print("\n" + markdown_table(results["tau_sweep"]) + "\n", flush=True)
        print(f"plot: {png}", flush=True)
    results["config"]["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
