"""The serving benchmark's tables (markdown), read off the JSON a run wrote (``--replot`` reads an
older file the same way)."""

from __future__ import annotations

from typing import Any, Dict

from benchmarks.serving.workload import turns_of


def dig(d: Any, *keys: str) -> Any:
    """``d[k0][k1]...``, None where a level is missing, None or not a dict."""
    for k in keys:
        if not isinstance(d, dict) or d.get(k) is None:
            return None
        d = d[k]
    return d


def _fmt(v, spec=".3f"):
    return "-" if v is None else format(v, spec)


def markdown(results: Dict[str, Any]) -> str:
    lines = [
        "| ctx | rate wf/s | method | TTFT p50 s | p90 | p99 | ratio p50 | e2e p50 s | wf lat p50 s "
        "| out tok/s | ratio | peak RSS MB | ratio | peak KV tok | ratio | rho | sat |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for p in results["qps_sweep"]:
        for m, r in p["methods"].items():
            ra = p["ratios"].get(m, {})
            t = r["ttft_s"] or {}
            lines.append(
                f"| {p['context']} | {p['rate']:g} | {m} | {_fmt(t.get('p50'))} | {_fmt(t.get('p90'))} | "
                f"{_fmt(t.get('p99'))} | {_fmt(ra.get('ttft_s.p50'), '.2f')} | {_fmt(dig(r, 'e2e_s', 'p50'))} | "
                f"{_fmt(dig(r, 'workflow_latency_s', 'p50'), '.2f')} | {_fmt(r['output_tok_s'], '.1f')} | "
                f"{_fmt(ra.get('output_tok_s'), '.2f')} | {_fmt(r['peak_rss_mb'], '.0f')} | "
                f"{_fmt(ra.get('peak_rss_mb'), '.3f')} | {_fmt(r['peak_kv_tokens'], '.0f')} | "
                f"{_fmt(ra.get('peak_kv_tokens'), '.2f')} | {_fmt(r['rho'], '.2f')} | {'yes' if r.get('saturated') else ''} |"
            )
    lines += [
        "",
        "later agents (turns after the first): TTFT p50 as a ratio to nonshared and to fullshared; "
        "rho_later = reused / shared tokens of those turns; corrections accepted / gated; correction "
        "ms p50; anchor bytes per token (one anchor, weighted by the tokens it served) vs KV bytes per token:",
        "",
        "| ctx | rate | method | later TTFT p50 s | vs nonshared | vs fullshared | later p90 s | fallback turns "
        "| their p90 s | rho_later | accepted | corr ms p50 | anchor B/tok | KV B/tok |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in results["qps_sweep"]:
        base = {m: dig(r, "ttft_later_s", "p50") for m, r in p["methods"].items()}
        for m, r in p["methods"].items():
            t = base[m]
            vs = lambda other: (t / base[other]) if t is not None and base.get(other) else None  # noqa: E731
            gated = r.get("corrections_accepted", 0) + r.get("corrections_rejected", 0)
            lines.append(
                f"| {p['context']} | {p['rate']:g} | {m} | {_fmt(t)} | {_fmt(vs('nonshared'), '.2f')} | "
                f"{_fmt(vs('fullshared'), '.2f')} | {_fmt(dig(r, 'ttft_later_s', 'p90'))} | "
                f"{r.get('fallback_turns', '')} | {_fmt(dig(r, 'ttft_fallback_s', 'p90'))} | {_fmt(r.get('rho_later'), '.2f')} | "
                f"{r.get('corrections_accepted', 0)}/{gated} | {_fmt(dig(r, 'correction_ms', 'p50'), '.0f')} | "
                f"{_fmt(r.get('anchor_bytes_per_token'), '.0f')} | {_fmt(r.get('kv_bytes_per_token'), '.0f')} |"
            )
    sat = results.get("saturation") or {}
    if sat:
        lines += [
            "",
            "saturation (highest rate sustained before the first saturated one; wf/s):",
            "",
            "| ctx | method | sustained | first saturated | sustained vs nonshared |",
            "|---:|---|---:|---:|---:|",
        ]
        for ctx, rows in sat.items():
            for m, row in rows.items():
                lines.append(
                    f"| {ctx} | {m} | {_fmt(row['sustained'], 'g')} | {_fmt(row['first_saturated'], 'g')} | "
                    f"{_fmt(row['sustained_vs_nonshared'], '.2f')} |"
                )
    cap = results.get("capacity") or {}
    if cap:
        lines += [
            "",
            f"capacity (closed loop, {results['config'].get('capacity')} workflows in flight; completions "
            "per second between the first and the last = the sustainable arrival rate):",
            "",
            "| ctx | method | wf/s | vs nonshared | vs fullshared | later TTFT p50 s | p90 s | fallback turns "
            "| their p90 s | recomputed rows | wf latency p50 s | rho_later |",
            "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for ctx, rows in cap.items():
            full = (rows.get("fullshared") or {}).get("wf_per_s")
            for m, row in rows.items():
                vs_full = row["wf_per_s"] / full if full and row["wf_per_s"] else None
                lines.append(
                    f"| {ctx} | {m} | {_fmt(row['wf_per_s'], '.4f')} | {_fmt(row['vs_nonshared'], '.2f')} | "
                    f"{_fmt(vs_full, '.2f')} | {_fmt(row['ttft_later_p50_s'], '.2f')} | "
                    f"{_fmt(row.get('ttft_later_p90_s'), '.2f')} | {row.get('fallback_turns', '')} | "
                    f"{_fmt(row.get('ttft_fallback_p90_s'), '.2f')} | {row.get('recomputed_rows', '')} | "
                    f"{_fmt(row['workflow_latency_p50_s'], '.1f')} | {_fmt(row['rho_later'], '.2f')} |"
                )
    for kind, pts in results.get("scaling", {}).items():
        if not pts:
            continue
        lines += [
            "",
            f"scaling by {kind} (ctx {pts[0]['context']}, rate {pts[0]['rate']:g}):",
            "",
            f"| {kind} | turns | method | TTFT p50 s | ratio | wf lat p50 s | ratio | rho |",
            "|---:|---:|---|---:|---:|---:|---:|---:|",
        ]
        for p in pts:
            for m, r in p["methods"].items():
                ra = p["ratios"].get(m, {})
                lines.append(
                    f"| {p[kind]} | {turns_of(p['agents'], p['rounds'])} | {m} | {_fmt(dig(r, 'ttft_s', 'p50'))} | "
                    f"{_fmt(ra.get('ttft_s.p50'), '.2f')} | {_fmt(dig(r, 'workflow_latency_s', 'p50'), '.2f')} | "
                    f"{_fmt(ra.get('workflow_latency_s.p50'), '.2f')} | {_fmt(r['rho'], '.2f')} |"
                )
    if results.get("skipped"):
        lines.append(f"\nskipped (saturation): {results['skipped']}")
    return "\n".join(lines)
