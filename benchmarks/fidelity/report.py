"""The fidelity benchmark's report: a markdown table of the per-label summaries and two plots (methods
side by side; the tau sweep's reuse against error)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Dict, List

from benchmarks.fidelity.summary import MethodSummary


LORA_COLUMNS = [
    ("method", None),
    ("prompt reuse", "prompt_reuse_later"),
    ("KL mean", "kl_mean"),
    ("KL later", "kl_mean_later"),
    ("top1", "top1_agree"),
    ("exact", "exact_match"),
    ("lead", "lead_agree"),
    ("computed", "computed_tokens"),
    ("rebuild", "rebuild_tokens"),
    ("KV B/token", "kv_bytes_per_token"),
    ("LR B/token/agent", "lr_bytes_per_token_per_agent"),
    ("accuracy", "accuracy"),
    ("tasks", "tasks"),
]
PROMPT_COLUMNS = [
    ("method", None),
    ("rho", "rho"),
    ("KV err mean", "kv_err_mean"),
    ("KV err pooled", "kv_err_pooled"),
    ("KV err all-shared", "kv_err_all_shared_pooled"),
    ("KL mean", "kl_mean"),
    ("KL later", "kl_mean_later"),
    ("top1", "top1_agree"),
    ("exact", "exact_match"),
    ("lead", "lead_agree"),
    ("computed", "computed_tokens"),
    ("acc/rej", None),
    ("anchor bytes", "anchor_bytes"),
    ("accuracy", "accuracy"),
    ("tasks", "tasks"),
]


def _entropy_cell(e) -> str:
    return "-" if not e else f"{e.p10:.3g} / {e.p50:.3g} / {e.p90:.3g} ({e.distinct} of {e.n})"


def markdown_table(summary: Dict[str, MethodSummary], lora: bool = False) -> str:
    cols = LORA_COLUMNS if lora else PROMPT_COLUMNS
    lines = ["| " + " | ".join(c for c, _ in cols) + " |", "|" + "---|" * len(cols)]
    for label, s in summary.items():
        row = []
        for name, key in cols:
            if name == "method":
                row.append(label)
            elif name == "acc/rej":
                row.append(f"{s.corrections_accepted}/{s.corrections_rejected}")
            else:
                v = getattr(s, key)
                row.append("-" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v)))
        lines.append("| " + " | ".join(row) + " |")
    gated = {label: s for label, s in summary.items() if s.entropy_q or s.entropy_out}
    if gated and not lora:
        lines += [
            "",
            "gate entropy of the later agents' segments by slot kind (p10 / p50 / p90, distinct values of n):",
            "",
            "| method | question slot | output slots |",
            "|---|---|---|",
        ]
        for label, s in gated.items():
            lines.append(f"| {label} | {_entropy_cell(s.entropy_q)} | {_entropy_cell(s.entropy_out)} |")
    return "\n".join(lines)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_methods(summary: Dict[str, MethodSummary], path: Path, lora: bool = False) -> None:
    plt = _pyplot()
    labels = list(summary)
    x = range(len(labels))
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 1.1 * len(labels) * 2), 4.8))
    panels = [
        ("computed_tokens", None, "computed prompt tokens, all turns")
        if lora
        else ("kv_err_pooled", "kv_err_mean", "normalized KV error of reused segments"),
        ("kl_mean", None, "KL(dense || approx), first token (nats)"),
    ]
    for ax, (key, key2, title) in zip(axes, panels):
        vals = [getattr(summary[m], key) or 0.0 for m in labels]
        bars = ax.bar(x, vals, color="tab:blue", label="pooled" if key2 else "mean")
        extra = [getattr(summary[m], key2) or 0.0 for m in labels] if key2 else []
        if key2:
            ax.scatter(x, extra, color="tab:red", zorder=3, label="mean over segments")
            ax.legend(fontsize=8)
        top = max(vals + extra + [1e-9])
        name = "reuse" if lora else "rho"
        for b, m in zip(bars, labels):
            rho = summary[m].prompt_reuse_later if lora else summary[m].rho
            text = f"{name}=-" if rho is None else f"{name}={rho:.2f}"
            ax.text(b.get_x() + b.get_width() / 2, b.get_height() + 0.02 * top, text, ha="center", fontsize=8)
        ax.set_xticks(list(x))
        ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.set_ylim(0, top * 1.18)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_sweep(sweep: Dict[str, MethodSummary], path: Path) -> None:
    plt = _pyplot()
    by_method: Dict[str, List] = defaultdict(list)
    for label, s in sweep.items():
        method, tau = label.split("@")
        by_method[method].append((float(tau), s))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    panels = (
        (axes[0], "kv_err_all_shared_pooled", "pooled KV error: all shared segments (solid), reused only (dashed)"),
        (axes[1], "kl_mean", "first-token KL(dense || approx)"),
    )
    for ax, key, title in panels:
        for method, pts in sorted(by_method.items(), key=lambda kv: kv[0]):
            pts.sort(key=lambda p: p[0])
            xs = [s.rho or 0.0 for _, s in pts]
            ys = [getattr(s, key) or 0.0 for _, s in pts]
            (line,) = ax.plot(xs, ys, "o-", label=method)
            if key == "kv_err_all_shared_pooled":
                ax.plot(xs, [s.kv_err_pooled or 0.0 for _, s in pts], "x--", color=line.get_color())
            for (tau, _), xx, yy in zip(pts, xs, ys):
                ax.annotate(f"tau={tau:g}", (xx, yy), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set_xlabel("reuse ratio rho (non-first agents)")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
