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
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Dict, List, Optional

from benchmarks import fidelity
from benchmarks.fidelity_metrics import load_dump, mean, safe_name
from sglang_kvshare.recompute import (
    DroidSpeakProfile,
    coverage_of_errors,
    entry_deviation,
    num_selected,
    random_mask_like,
    token_deviation,
)
from sglang_kvshare.recompute.coverage import DEFAULT_SEEDS

RHOS = (0.9, 0.8)
CRITERIA = ("layer", "deviation", "attention")
METHODS = fidelity.RECOMPUTE_METHODS
CHECK_LAYER = 1
MAX_GROUPS = 2


# ----------------------------------------------------------------------------- pairs


def segment_pairs(runs: List[Dict[str, Any]], dump_root: Path):
    """(run, turn, slot, reused dump, exact dump) of every reused segment of a later agent."""
    for run in runs:
        if "error" in run:
            continue
        for turn in run["turns"]:
            if turn["position"] == 0:
                continue
            for err in turn.get("seg_errors") or []:
                if err.get("mode") != "injected" or "rel" not in err:
                    continue
                shadow = run["workflow"].replace("fid:", "fidshadow:", 1)
                name = f"{safe_name(err['slot'])}.pt"
                reused = dump_root / safe_name(run["workflow"]) / safe_name(turn["agent"]) / name
                exact = dump_root / safe_name(shadow) / safe_name(turn["agent"]) / name
                yield run, turn, err["slot"], load_dump(reused), load_dump(exact)


def flat(dump) -> tuple:
    """(k, v) as ``[num_layers, n, kv_heads * head_dim]`` float32."""
    k, v = dump["k"].float(), dump["v"].float()
    return k.reshape(k.shape[0], k.shape[1], -1), v.reshape(v.shape[0], v.shape[1], -1)


# ----------------------------------------------------------------------------- attention


class AttentionReader:
    """Attention importance of prompt tokens from a transformers forward of the same ids."""

    def __init__(self, model_path: str):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.tok = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, torch_dtype=torch.float32, attn_implementation="eager"
        ).eval()
        self._last: tuple = (None, None)  # (key, result): pairs of one turn come in a row

    def prompt(self, run: Dict[str, Any], turn: Dict[str, Any]):
        """The turn's prompt ids and spans, tokenised as the server does (exact output ids for
        the ``out:<agent>`` slots)."""
        from sglang_kvshare.integration.server.annotate import exact_output_ids, special_prefix
        from sglang_kvshare.segments import parse_annotation, tokenize_segments

        outputs = {t["agent"]: t for t in run["turns"]}

        def slot_tokens(slot: str, text: str):
            prev = outputs.get(slot[len("out:"):]) if slot.startswith("out:") else None
            if prev is None or prev["text"] != text:
                return None
            return exact_output_ids(self.tok, prev["output_ids"], text)

        ann = parse_annotation(turn["payload_kvshare"], "nonshared")
        return tokenize_segments(
            ann.segments, lambda t: self.tok.encode(t, add_special_tokens=False),
            special_prefix(self.tok), slot_tokens,
        )

    def importance(self, run: Dict[str, Any], turn: Dict[str, Any]):
        """(prompt ids, float [prompt_len]): attention each position receives from the prompt's
        tokens after its last shared segment, mean over layers, heads and those queries."""
        key = f"{run['workflow']}/{turn['agent']}"
        if self._last[0] != key:
            torch = self.torch
            prompt = self.prompt(run, turn)
            last = max(s.end for s in prompt.spans if s.slot is not None)
            ids = torch.tensor([prompt.input_ids])
            with torch.no_grad():
                att = self.model(ids, output_attentions=True).attentions  # L x [1, H, T, T]
            mass = torch.stack([a[0, :, last:, :].mean(dim=(0, 1)) for a in att]).mean(0)
            self._last = (key, (prompt.input_ids, mass))
        return self._last[1]


# ----------------------------------------------------------------------------- coverage


def layer_mask(profile: DroidSpeakProfile, ratio: float, seg_len: int):
    return profile.plan(ratio, seg_len, MAX_GROUPS).mask


def token_mask(scores, ratio: float, num_layers: int):
    import torch

    k = num_selected(ratio, scores.numel())
    mask = torch.zeros(num_layers, scores.numel(), dtype=torch.bool)
    mask[:, torch.argsort(scores, descending=True, stable=True)[:k]] = True
    return mask


def coverage_entry(errors, mask) -> Dict[str, float]:
    cov = coverage_of_errors(errors, mask)
    rnd = mean(coverage_of_errors(errors, random_mask_like(mask, s)) for s in DEFAULT_SEEDS)
    return {"coverage": cov, "random": rnd, "relative": cov / rnd if rnd else float("nan"),
            "err2": float(errors.sum()), "removed2": float(errors[mask].sum())}


def analyse_coverage(runs, dump_root: Path, profile: DroidSpeakProfile, reader: AttentionReader) -> List[Dict]:
    out = []
    for run, turn, slot, reused, exact in segment_pairs(runs, dump_root):
        r, e = flat(reused), flat(exact)
        errors = entry_deviation(r, e)  # [L, n]
        num_layers, n = errors.shape
        ids, mass = reader.importance(run, turn)
        start = exact["start"]
        if list(ids[start:start + n]) != list(exact["token_ids"]):
            out.append({"task_id": run["task_id"], "agent": turn["agent"], "slot": slot, "mismatch": True})
            continue
        dev = token_deviation((r[0][CHECK_LAYER], r[1][CHECK_LAYER]), (e[0][CHECK_LAYER], e[1][CHECK_LAYER]))
        att = mass[start:start + n]
        rec: Dict[str, Any] = {"task_id": run["task_id"], "agent": turn["agent"], "slot": slot, "tokens": n,
                               "rel_err": float((errors.sum() / sum(x.pow(2).sum() for x in e)).sqrt())}
        for rho in RHOS:
            ratio = round(1.0 - rho, 6)
            masks = {
                "layer": layer_mask(profile, ratio, n),
                "deviation": token_mask(dev, ratio, num_layers),
                "attention": token_mask(att, ratio, num_layers),
            }
            rec[str(rho)] = {c: coverage_entry(errors, m) for c, m in masks.items()}
        out.append(rec)
    return out


def summarise_coverage(pairs: List[Dict]) -> Dict[str, Any]:
    ok = [p for p in pairs if "mismatch" not in p]
    summary: Dict[str, Any] = {"segments": len(ok), "mismatched": len(pairs) - len(ok)}
    for rho in RHOS:
        row = {}
        for c in CRITERIA:
            es = [p[str(rho)][c] for p in ok]
            removed, total = sum(e["removed2"] for e in es), sum(e["err2"] for e in es)
            row[c] = {
                "coverage_mean": mean(e["coverage"] for e in es),
                "random_mean": mean(e["random"] for e in es),
                "relative_mean": mean(e["relative"] for e in es),
                "coverage_pooled": removed / total if total else None,
            }
        summary[str(rho)] = row
    return summary


def build_profile(runs, dump_root: Path) -> DroidSpeakProfile:
    profile = None
    for _, _, _, reused, exact in segment_pairs(runs, dump_root):
        r, e = flat(reused), flat(exact)
        if profile is None:
            profile = DroidSpeakProfile(r[0].shape[0])
        profile.accumulate(r, e)
    if profile is None:
        raise RuntimeError("no reused segment in the profiling runs")
    return profile


# ----------------------------------------------------------------------------- report


def coverage_table(summary: Dict[str, Any]) -> str:
    lines = ["| rho | criterion | coverage | random | relative | pooled coverage |", "|---|---|---:|---:|---:|---:|"]
    for rho in RHOS:
        for c in CRITERIA:
            s = summary[str(rho)][c]
            lines.append(f"| {rho} | {c} | {s['coverage_mean']:.3f} | {s['random_mean']:.3f} | "
                         f"{s['relative_mean']:.2f} | {s['coverage_pooled']:.3f} |")
    return "\n".join(lines)


def realised_rho(s: Dict[str, Any]) -> Optional[float]:
    total = s.get("shared_token_layers") or 0
    return round(1.0 - s["recomputed_token_layers"] / total, 4) if total else None


def engine_table(main: Dict[str, Dict[str, Any]]) -> str:
    lines = ["| method | token-layer rho | KL mean | top1 | exact greedy | lead | KV err pooled | tasks |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for label, s in main.items():
        rho = realised_rho(s) if s.get("shared_token_layers") else s.get("rho")

        def f(x, nd=4):
            return "-" if x is None else f"{x:.{nd}g}"

        lines.append(f"| {label} | {f(rho)} | {f(s['kl_mean'])} | {f(s['top1_agree'])} | {f(s['exact_match'])} | "
                     f"{f(s['lead_agree'])} | {f(s['kv_err_pooled'])} | {s['tasks']} |")
    return "\n".join(lines)


def plot(results: Dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cov = results["coverage"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    width = 0.2
    for j, rho in enumerate(RHOS):
        xs = [i + (j - 0.5) * 2 * width for i in range(len(CRITERIA))]
        vals = [cov[str(rho)][c]["coverage_mean"] for c in CRITERIA]
        rnd = [cov[str(rho)][c]["random_mean"] for c in CRITERIA]
        axes[0].bar([x - width / 2 for x in xs], vals, width, label=f"criterion, rho {rho}", color=f"C{j}")
        axes[0].bar([x + width / 2 for x in xs], rnd, width, label=f"random, rho {rho}", color=f"C{j}", alpha=0.35)
        axes[1].bar(xs, [cov[str(rho)][c]["relative_mean"] for c in CRITERIA], 2 * width, label=f"rho {rho}", color=f"C{j}")
    for ax, title in ((axes[0], "coverage (fraction of reuse error removed)"), (axes[1], "relative coverage (vs random)")):
        ax.set_xticks(range(len(CRITERIA)), ["layer\n(DroidSpeak)", "deviation\n(CacheBlend)", "attention\n(RelayCaching)"])
        ax.set_title(title)
        ax.legend(fontsize=8)
    axes[1].axhline(1.0, color="grey", lw=0.8, ls="--")
    main = results.get("main") or {}
    labels = list(main)
    ax = axes[2]
    ax.bar(range(len(labels)), [main[lab]["kl_mean"] or 0 for lab in labels], color="C3", label="first-token KL")
    ax2 = ax.twinx()
    ax2.plot(range(len(labels)), [main[lab]["exact_match"] or 0 for lab in labels], "ko-", label="exact greedy")
    ax2.set_ylim(0, 1.05)
    ax.set_xticks(range(len(labels)), labels, rotation=35, ha="right", fontsize=8)
    ax.set_title("engine vs nonshared (MMLU workflow)")
    ax.set_ylabel("KL (nats)")
    ax2.set_ylabel("exact greedy agreement")
    fig.legend(*[sum(x, []) for x in zip(ax.get_legend_handles_labels(), ax2.get_legend_handles_labels())],
               loc="upper right", fontsize=8)
    cfg = results["config"]
    fig.suptitle(f"Selective recomputation, SmolLM2-135M, {len(cfg['eval_tasks'])} {cfg['dataset']} tasks "
                 f"({cfg['segments']} reused segments)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------- main


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", type=int, default=40, help="evaluation tasks (default 40, as benchmarks.fidelity)")
    ap.add_argument("--profile-tasks", type=int, default=8, help="DroidSpeak profiling tasks (default 8)")
    ap.add_argument("--quick", action="store_true", help="1 profiling + 2 evaluation tasks")
    ap.add_argument("--dataset", default="mmlu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--out", default="results/coverage.json")
    ap.add_argument("--profile-out", default="results/droidspeak_profile_smollm2.json")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--skip-engine", action="store_true", help="part 1 only")
    args = ap.parse_args(argv)
    if args.quick:
        args.tasks, args.profile_tasks = min(args.tasks, 2), min(args.profile_tasks, 1)
    # what benchmarks.fidelity's Backend / run_plan read
    args.agents, args.server_url, args.dump_dir, args.keep_dumps = "prompt", None, None, True
    args.max_total_tokens, args.tau, args.server_timeout, args.request_timeout = 32768, 0.3, 900, 900
    args.sanity_tasks = 1
    return args


def main(argv=None) -> int:
    from sglang_kvshare.assets import ensure_default_model
    from benchmarks.datasets import load_tasks
    from sglang_kvshare.workflows import get_roles

    args = parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="kvshare-coverage-"))
    workdir.mkdir(parents=True, exist_ok=True)
    # the evaluation tasks are the fidelity benchmark's (same dataset, count and seed); the
    # profiling tasks are other tasks of the dataset
    eval_tasks = load_tasks(args.dataset, args.tasks, seed=args.seed)
    taken = {t.id for t in eval_tasks}
    prof_tasks = [t for t in load_tasks(args.dataset, args.tasks + args.profile_tasks, seed=args.seed + 1)
                  if t.id not in taken][: args.profile_tasks]
    roles = get_roles(args.dataset)
    tag = uuid.uuid4().hex[:8]
    results: Dict[str, Any] = {
        "config": {"dataset": args.dataset, "profile_tasks": [t.id for t in prof_tasks],
                   "eval_tasks": [t.id for t in eval_tasks], "rhos": list(RHOS), "check_layer": CHECK_LAYER,
                   "max_groups": MAX_GROUPS, "methods": args.methods.split(","), "max_new_tokens": args.max_new_tokens,
                   "argv": sys.argv[1:], "git_head": fidelity._git_head(), "workdir": str(workdir),
                   "started": time.strftime("%Y-%m-%d %H:%M:%S")},
        "notes": __doc__.split("Usage")[0].strip(),
    }

    def save():
        results["config"]["updated"] = time.strftime("%Y-%m-%d %H:%M:%S")
        fidelity.write_results(results, out)

    # part 1: fullshared turns and their dense shadows, dumps kept
    backend = fidelity.Backend(args, workdir, "coverage")
    try:
        plan = [("fullshared", "fullshared", None)]
        fidelity.run_plan(args, backend, prof_tasks, roles, plan, tag, results, "profile", save)
        fidelity.run_plan(args, backend, eval_tasks, roles, plan, tag, results, "coverage_source", save)
    finally:
        backend.stop()
    # the payload's annotation is needed to rebuild prompt ids; run_one keeps it per turn
    profile = build_profile(results["profile_runs"]["fullshared"], backend.dump_root)
    Path(args.profile_out).write_text(json.dumps(
        {"model": "SmolLM2-135M-Instruct", "dataset": args.dataset, "tasks": [t.id for t in prof_tasks],
         "samples": profile.num_samples, "relative": profile.relative,
         "layer_deviation": [round(float(x), 8) for x in profile.layer_deviation()]}, indent=1))
    reader = AttentionReader(str(ensure_default_model()))
    pairs = analyse_coverage(results["coverage_source_runs"]["fullshared"], backend.dump_root, profile, reader)
    results["coverage_pairs"] = pairs
    results["coverage"] = summarise_coverage(pairs)
    results["config"]["segments"] = results["coverage"]["segments"]
    results["droidspeak_groups"] = {str(rho): profile.choose_groups(round(1 - rho, 6), MAX_GROUPS) for rho in RHOS}
    save()
    print("\ncoverage:\n" + coverage_table(results["coverage"]) + "\n", flush=True)

    # part 2: the engine's methods at rho 0.9 and 0.8
    if not args.skip_engine:
        backend = fidelity.Backend(args, workdir, "engine",
                                   extra_flags=["--kvshare-droidspeak-profile", str(Path(args.profile_out).resolve())])
        try:
            plan = [("nonshared", "nonshared", None), ("fullshared", "fullshared", None)]
            plan += [(f"{m}@rho{rho}", m, None, round(1 - rho, 6)) for rho in RHOS for m in args.methods.split(",")]
            fidelity.run_plan(args, backend, eval_tasks, roles, plan, tag, results, "main", save)
        finally:
            backend.stop()
        for s in results["main"].values():
            s["token_layer_rho"] = realised_rho(s)
        print("\nengine:\n" + engine_table(results["main"]) + "\n", flush=True)
    results["config"]["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    save()
    plot(results, out.with_suffix(".png"))
    print(f"plot: {out.with_suffix('.png')}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
