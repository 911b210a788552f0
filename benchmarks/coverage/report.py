"""The coverage benchmark's report: the coverage and engine tables and the plot."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Mapping

from benchmarks.coverage.selection import CRITERIA, RHOS, CoverageSummary
from benchmarks.fidelity.summary import MethodSummary


@dataclass(frozen=True)
class EngineSummary:
    """A label of the engine part: the fidelity summary, written with its realised token-layer
    reuse (``token_layer_rho``) added."""

    summary: MethodSummary

    def to_json(self) -> Dict[str, Any]:
        return {**self.summary.to_json(), "token_layer_rho": self.summary.token_layer_rho}


def coverage_table(summary: CoverageSummary) -> str:
    lines = ["| rho | criterion | coverage | random | relative | pooled coverage |", "|---|---|---:|---:|---:|---:|"]
    for rho in RHOS:
        for c in CRITERIA:
            s = summary.by_rho[rho][c]
            lines.append(
                f"| {rho} | {c} | {s.coverage_mean:.3f} | {s.random_mean:.3f} | "
                f"{s.relative_mean:.2f} | {s.coverage_pooled:.3f} |"
            )
    return "\n".join(lines)


def _g(x, nd=4) -> str:
    return "-" if x is None else f"{x:.{nd}g}"


def engine_table(main: Mapping[str, MethodSummary]) -> str:
    lines = [
        "| method | token-layer rho | KL mean | top1 | exact greedy | lead | KV err pooled | tasks |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, s in main.items():
        rho = s.token_layer_rho if s.shared_token_layers else s.rho
        lines.append(
            f"| {label} | {_g(rho)} | {_g(s.kl_mean)} | {_g(s.top1_agree)} | {_g(s.exact_match)} | "
            f"{_g(s.lead_agree)} | {_g(s.kv_err_pooled)} | {s.tasks} |"
        )
    return "\n".join(lines)


def plot(cov: CoverageSummary, main: Mapping[str, MethodSummary], title: str, path: Path) -> None:
    """Coverage and relative coverage by criterion and rho, and the engine's labels against
    nonshared (``main``; empty without the engine part)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    width = 0.2
    for j, rho in enumerate(RHOS):
        xs = [i + (j - 0.5) * 2 * width for i in range(len(CRITERIA))]
        row = cov.by_rho[rho]
        vals = [row[c].coverage_mean for c in CRITERIA]
        rnd = [row[c].random_mean for c in CRITERIA]
        rel = [row[c].relative_mean for c in CRITERIA]
        axes[0].bar([x - width / 2 for x in xs], vals, width, label=f"criterion, rho {rho}", color=f"C{j}")
        axes[0].bar([x + width / 2 for x in xs], rnd, width, label=f"random, rho {rho}", color=f"C{j}", alpha=0.35)
        axes[1].bar(xs, rel, 2 * width, label=f"rho {rho}", color=f"C{j}")
    names = ["layer\n(DroidSpeak)", "deviation\n(CacheBlend)", "attention\n(RelayCaching)"]
    for ax, name in (
        (axes[0], "coverage (fraction of reuse error removed)"),
        (axes[1], "relative coverage (vs random)"),
    ):
        ax.set_xticks(range(len(CRITERIA)), names)
        ax.set_title(name)
        ax.legend(fontsize=8)
    axes[1].axhline(1.0, color="grey", lw=0.8, ls="--")
    labels = list(main)
    ax = axes[2]
    ax.bar(range(len(labels)), [main[lab].kl_mean or 0 for lab in labels], color="C3", label="first-token KL")
    ax2 = ax.twinx()
    ax2.plot(range(len(labels)), [main[lab].exact_match or 0 for lab in labels], "ko-", label="exact greedy")
    ax2.set_ylim(0, 1.05)
    ax.set_xticks(range(len(labels)), labels, rotation=35, ha="right", fontsize=8)
    ax.set_title("engine vs nonshared (MMLU workflow)")
    ax.set_ylabel("KL (nats)")
    ax2.set_ylabel("exact greedy agreement")
    handles = [sum(x, []) for x in zip(ax.get_legend_handles_labels(), ax2.get_legend_handles_labels())]
    fig.legend(*handles, loc="upper right", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
