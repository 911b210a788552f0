"""The serving benchmark's figures, drawn from the JSON a run wrote: TTFT vs rate, peak memory vs
context, corrections accepted over the run, and the scaling sweeps; each with the ratio to
nonshared beneath the absolute numbers."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any, Dict, List

from benchmarks.serving.report import dig
from benchmarks.serving.results import ratio_table
from benchmarks.serving.workload import BASELINE


def _series(points, method, key, x_of):
    xs, ys = [], []
    for p in points:
        v = dig(p["methods"].get(method, {}), *key.split("."))  # a ratio key names the metric's path
        if v is not None:
            xs.append(x_of(p))
            ys.append(v)
    return xs, ys


def _ratio_series(points, method, key, x_of):
    xs, ys = [], []
    for p in points:
        v = p["ratios"].get(method, {}).get(key)
        if v is not None:
            xs.append(x_of(p))
            ys.append(v)
    return xs, ys


def _panel_pair(ax_abs, ax_ratio, points, methods, key, x_of, ylabel, annotate=True):
    for i, m in enumerate(methods):
        xs, ys = _series(points, m, key, x_of)
        ax_abs.plot(xs, ys, "o-", color=f"C{i}", label=m)
        rx, ry = _ratio_series(points, m, key, x_of)
        ax_ratio.plot(rx, ry, "o-", color=f"C{i}", label=m)
        if annotate and m != BASELINE:
            for x, y in zip(rx, ry):
                ax_ratio.annotate(
                    f"{y:.2f}", (x, y), xytext=(0, 4), textcoords="offset points", ha="center", fontsize=7
                )
    ax_abs.set_ylabel(ylabel)
    ax_ratio.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax_ratio.set_ylabel(f"ratio vs {BASELINE}")


def plot(results: Dict[str, Any], out: Path) -> List[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = results["config"]["methods"]
    paths = []
    qps = results["qps_sweep"]
    title = f"{Path(str(results['servers'][0].get('model_path'))).name}, {results['host']['machine']}"
    if qps:
        ctxs = sorted({p["context"] for p in qps})
        fig, axes = plt.subplots(2, len(ctxs), figsize=(4.2 * len(ctxs), 6.5), squeeze=False, sharex="col")
        for j, c in enumerate(ctxs):
            pts = [p for p in qps if p["context"] == c]
            _panel_pair(axes[0][j], axes[1][j], pts, methods, "ttft_s.p50", lambda p: p["rate"], "TTFT p50, s")
            for i, m in enumerate(methods):  # p90 dashed
                xs, ys = _series(pts, m, "ttft_s.p90", lambda p: p["rate"])
                axes[0][j].plot(xs, ys, "--", color=f"C{i}", alpha=0.5)
            axes[0][j].set_title(f"shared context {c} tokens")
            axes[1][j].set_xlabel("workflow arrival rate, wf/s (0 = single stream)")
        axes[0][0].legend(fontsize=8, title="solid p50, dashed p90", title_fontsize=7)
        fig.suptitle(f"TTFT vs request rate ({title})")
        fig.tight_layout()
        p = out.with_name(out.stem + "_ttft_vs_qps.png")
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)

        # memory vs context: the highest peak over the rates of each context
        mem_pts = []
        for c in ctxs:
            by_m = {}
            for m in methods:
                vals = [p["methods"][m] for p in qps if p["context"] == c and m in p["methods"]]
                if vals:  # per metric, the highest value over the rates
                    by_m[m] = {
                        k: max((v[k] for v in vals if v.get(k) is not None), default=None)
                        for k in ("peak_rss_mb", "peak_rss_delta_mb", "peak_gpu_mb", "peak_kv_tokens")
                    }
            mem_pts.append({"context": c, "methods": by_m, "ratios": ratio_table(by_m)})
        keys = [
            ("peak_rss_mb", "peak RSS of server tree, MB"),
            ("peak_rss_delta_mb", "RSS growth during run, MB"),
            ("peak_kv_tokens", "peak KV slots in use, tokens"),
        ]
        if any(dig(r, "peak_gpu_mb") for p in mem_pts for r in p["methods"].values()):
            keys.append(("peak_gpu_mb", "peak GPU memory, MB"))
        fig, axes = plt.subplots(2, len(keys), figsize=(4.5 * len(keys), 6.5), squeeze=False, sharex="col")
        for j, (key, label) in enumerate(keys):
            _panel_pair(axes[0][j], axes[1][j], mem_pts, methods, key, lambda p: p["context"], label)
            axes[1][j].set_xlabel("shared context, tokens")
        axes[0][0].legend(fontsize=8)
        for ax in axes.flat:
            ax.ticklabel_format(axis="y", useOffset=False, style="plain")
        fig.suptitle(f"Peak memory vs context (max over rates; {title})")
        fig.tight_layout()
        p = out.with_name(out.stem + "_memory_vs_context.png")
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)

    timeline = [r for r in results.get("timeline", []) if r.get("turn", 0) > 0]
    if timeline:
        p = out.with_name(out.stem + "_acceptance.png")
        plot_timeline(timeline, p, title)
        paths.append(p)

    sc = {k: v for k, v in results.get("scaling", {}).items() if v}
    if sc:
        fig, axes = plt.subplots(2, 2 * len(sc), figsize=(4.2 * 2 * len(sc), 6.5), squeeze=False, sharex="col")
        for j, (kind, pts) in enumerate(sc.items()):
            for k, (key, label) in enumerate(
                (("ttft_s.p50", "TTFT p50, s"), ("workflow_latency_s.p50", "workflow latency p50, s"))
            ):
                col = 2 * j + k
                _panel_pair(axes[0][col], axes[1][col], pts, methods, key, lambda p, kind=kind: p[kind], label)
                axes[0][col].set_title(f"vary {kind}")
                axes[1][col].set_xlabel(kind)
        axes[0][0].legend(fontsize=8)
        fig.suptitle(
            f"Scaling (ctx {results['config']['scaling_context']}, rate {results['config']['scaling_rate']:g}; {title})"
        )
        fig.tight_layout()
        p = out.with_name(out.stem + "_scaling.png")
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)
    return paths


def plot_timeline(timeline: List[Dict[str, Any]], path: Path, title: str, window: int = 10) -> None:
    """Per correction method: the share of gated corrections accepted and rho (reused / shared
    tokens) of the later agents, as a moving average over ``window`` requests in the order they
    ran (warm-up, pre-serve and measured requests alike; phases shaded)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = [
        m
        for m in dict.fromkeys(r["method"] for r in timeline)
        if any(r.get("accepted") or r.get("rejected") for r in timeline if r["method"] == m)
    ]
    if not methods:
        methods = list(dict.fromkeys(r["method"] for r in timeline))
    fig, axes = plt.subplots(len(methods), 1, figsize=(9, 2.6 * len(methods)), squeeze=False)
    for ax, m in zip(axes[:, 0], methods):
        rows = [r for r in timeline if r["method"] == m]
        xs = list(range(len(rows)))

        def moving(vals):
            return [statistics.fmean(vals[max(0, i - window + 1) : i + 1]) for i in range(len(vals))]

        acc = [(r.get("accepted") or 0) / max(1, (r.get("accepted") or 0) + (r.get("rejected") or 0)) for r in rows]
        rho = [(r.get("reused_tokens") or 0) / max(1, r.get("shared_tokens") or 0) for r in rows]
        ax.plot(xs, moving(acc), label="accepted / gated")
        ax.plot(xs, moving(rho), label="rho (later agents)")
        for i, r in enumerate(rows):
            if r["phase"] != "measured":
                ax.axvspan(i - 0.5, i + 0.5, color="0.9", lw=0)
        ax.set_ylim(-0.05, 1.05)
        ax.set_ylabel(m)
        ax.legend(fontsize=7, loc="lower right")
    axes[-1, 0].set_xlabel(f"later-agent request, in run order (moving mean of {window}; grey: warm-up / pre-serve)")
    fig.suptitle(f"Corrections accepted and reuse over the run ({title})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
