"""Quality against reuse: first-token KL and top-1 agreement with dense against rho, every method
of the given fidelity/coverage runs on one plot per dataset.

Reads the ``main`` summaries of ``benchmarks.fidelity`` and ``benchmarks.coverage`` results (each
label measured against the dense shadow on the same tasks) and joins the runs that measured the
same task list. A label's *family* is the label without its reuse setting (``+rho0.9``,
``@rho0.8``), so one family's points at several targets make one curve. The runs themselves are the
fidelity commands of benchmarks/README.md (``--methods kvcmas+rho0.7,...``, a server per variant).

Usage:
    python -m benchmarks.frontier results/fidelity_head.json results/coverage.json ... \
        --out results/frontier_mmlu
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

RHO_SETTING = re.compile(r"(\+rho[0-9.]+|@rho[0-9.]+)")
REFERENCE = "fullshared"


@dataclass(frozen=True)
class Point:
    """One label of one run: its reuse and its quality against dense."""

    family: str
    label: str
    source: str
    rho: float
    kl: float
    top1: float
    exact: float
    computed_tokens: int

    @staticmethod
    def family_of(label: str) -> str:
        return RHO_SETTING.sub("", label)


def _tasks(results: dict) -> Tuple[str, ...]:
    cfg = results.get("config", {})
    return tuple(cfg.get("tasks") or cfg.get("eval_tasks") or ())


def load_points(
    paths: Sequence[Path], renames: Optional[Dict[Tuple[str, str], str]] = None
) -> Dict[Tuple[str, ...], List[Point]]:
    """Points by the measured task list, each run's label its own point; ``renames``: (file name,
    label) -> the label to show (a variant whose meaning changed between runs)."""
    by_tasks: Dict[Tuple[str, ...], List[Point]] = defaultdict(list)
    for path in paths:
        results = json.loads(Path(path).read_text())
        tasks = _tasks(results)
        for label, s in (results.get("main") or {}).items():
            if s.get("kl_mean") is None or s.get("rho") is None or label == "nonshared":
                continue
            label = (renames or {}).get((Path(path).name, label), label)
            by_tasks[tasks].append(
                Point(
                    family=Point.family_of(label),
                    label=label,
                    source=Path(path).name,
                    rho=float(s["rho"]),
                    kl=float(s["kl_mean"]),
                    top1=float(s["top1_agree"]),
                    exact=float(s["exact_match"]),
                    computed_tokens=int(s["computed_tokens"]),
                )
            )
    return by_tasks


def dedupe(points: List[Point]) -> List[Point]:
    """The reference (deterministic) once; every other point as measured."""
    seen_ref = False
    out = []
    for p in points:
        if p.family == REFERENCE:
            if seen_ref:
                continue
            seen_ref = True
        out.append(p)
    return out


def markdown(points: List[Point]) -> str:
    ref = next((p for p in points if p.family == REFERENCE), None)
    lines = [
        "| label | run | rho | first-token KL | vs fullshared | top-1 | exact 16-token | computed tokens |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for p in sorted(points, key=lambda p: (-p.rho, p.kl)):
        ratio = f"{p.kl / ref.kl:.2f}" if ref and ref.kl > 0 else "-"
        lines.append(
            f"| {p.label} | {p.source} | {p.rho:.3f} | {p.kl:.4f} | {ratio} | {p.top1:.4f} | {p.exact:.3f} | "
            f"{p.computed_tokens:,} |"
        )
    return "\n".join(lines)


def frontier(points: List[Point]) -> List[Point]:
    """The points no other point beats on both reuse and KL (higher rho, lower KL)."""
    return [
        p
        for p in points
        if not any((q.rho >= p.rho and q.kl < p.kl) or (q.rho > p.rho and q.kl <= p.kl) for q in points)
    ]


def plot(points: List[Point], out: Path, title: str, bounds: Optional[Tuple[float, float, float]] = None) -> None:
    """KL (log) and top-1 against rho, one curve per family; ``bounds``: (rho, KL, top-1) of the
    target region, drawn as dashed lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_kl, ax_top) = plt.subplots(1, 2, figsize=(12, 4.8))
    families: Dict[str, List[Point]] = defaultdict(list)
    for p in points:
        families[p.family].append(p)
    for family, ps in sorted(families.items()):
        ps = sorted(ps, key=lambda p: p.rho)
        xs = [p.rho for p in ps]
        (line,) = ax_kl.plot(xs, [p.kl for p in ps], marker="o", label=family)
        ax_top.plot(xs, [p.top1 for p in ps], marker="o", color=line.get_color(), label=family)
    best = frontier(points)
    ax_kl.scatter([p.rho for p in best], [p.kl for p in best], s=140, facecolors="none", edgecolors="black")
    if bounds:
        rho, kl, top1 = bounds
        for ax in (ax_kl, ax_top):
            ax.axvline(rho, color="grey", linestyle="--", linewidth=0.8)
        ax_kl.axhline(kl, color="grey", linestyle="--", linewidth=0.8)
        ax_top.axhline(top1, color="grey", linestyle="--", linewidth=0.8)
    ax_kl.set_yscale("log")
    ax_kl.set_xlabel("reuse rho")
    ax_kl.set_ylabel("first-token KL to dense (circled: the frontier)")
    ax_top.set_xlabel("reuse rho")
    ax_top.set_ylabel("top-1 agreement with dense")
    ax_top.legend(fontsize=7, loc="lower left")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.frontier", description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", type=Path, help="fidelity or coverage results JSON files")
    ap.add_argument("--out", required=True, type=Path, help="path stem: writes STEM.md and STEM.png")
    ap.add_argument("--kl-bound", type=float, default=0.2, help="target KL as a fraction of fullshared's")
    ap.add_argument("--rho-bound", type=float, default=0.85)
    ap.add_argument("--top1-bound", type=float, default=0.98)
    ap.add_argument("--families", default="", help="comma-separated families to keep (default: all)")
    ap.add_argument(
        "--rename", action="append", default=[], metavar="FILE:LABEL=NEW", help="show LABEL of results file FILE as NEW"
    )
    args = ap.parse_args(argv)
    renames = {}
    for spec in args.rename:
        where, _, new = spec.partition("=")
        name, _, label = where.partition(":")
        if not (name and label and new):
            raise SystemExit(f"--rename wants FILE:LABEL=NEW, got {spec!r}")
        renames[(name, label)] = new
    groups = load_points(args.results, renames)
    if not groups:
        raise SystemExit("no measured label in the given files")
    tasks, points = max(groups.items(), key=lambda kv: len(kv[1]))
    skipped = sum(len(ps) for t, ps in groups.items() if t != tasks)
    keep = set(filter(None, args.families.split(",")))
    points = dedupe([p for p in points if not keep or p.family in keep])
    if not points:
        raise SystemExit(f"no label of the families {sorted(keep)} in the given files")
    ref = next((p for p in points if p.family == REFERENCE), None)
    dataset = tasks[0].split("/")[0] if tasks else "?"
    bounds = (args.rho_bound, args.kl_bound * ref.kl, args.top1_bound) if ref else None
    args.out.parent.mkdir(parents=True, exist_ok=True)
    title = f"{dataset}: {len(tasks)} tasks, {len(points)} labels"
    plot(points, args.out.with_suffix(".png"), title, bounds)
    table = markdown(points)
    note = f"\n\n{skipped} labels of runs on other task lists left out.\n" if skipped else "\n"
    args.out.with_suffix(".md").write_text(f"# Frontier: {title}\n\n{table}{note}")
    print(table + note + f"plot: {args.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
