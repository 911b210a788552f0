"""python -m benchmarks.serving --quick against the tiny server: JSON keys, exact lengths, positive numbers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_serving_quick(tiny_server, tmp_path):
    out = tmp_path / "serving.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.serving",
            "--url",
            tiny_server.url,
            "--quick",
            "--capacity",
            "2",
            "--out",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(out.read_text())
    cfg = res["config"]
    assert cfg["methods"] == ["nonshared", "fullshared", "kvcmas"]
    for suffix in ("_ttft_vs_qps.png", "_memory_vs_context.png", "_scaling.png"):
        assert (tmp_path / f"serving{suffix}").stat().st_size > 0
    assert [(s["name"], bool(s["pid"]), s["started_here"]) for s in res["servers"]] == [("main", True, False)]

    points = res["qps_sweep"]
    assert [(p["context"], p["rate"]) for p in points] == [(c, r) for c in cfg["contexts"] for r in cfg["rates"]]
    assert set(res["scaling"]) == {"agents", "rounds"}
    # closed loop: every method of every context completed its workflows, rates relative to nonshared
    assert set(res["capacity"]) == {str(c) for c in cfg["contexts"]}
    for rows in res["capacity"].values():
        assert set(rows) == set(cfg["methods"])
        for m, row in rows.items():
            assert row["errors"] == 0 and row["wf_per_s"] > 0 and row["wf_per_s_makespan"] > 0, (m, row)
        assert rows["nonshared"]["vs_nonshared"] == 1.0
    assert [p["agents"] for p in res["scaling"]["agents"]] == cfg["agents"]
    assert [p["rounds"] for p in res["scaling"]["rounds"]] == cfg["rounds"]
    for p in points + res["scaling"]["agents"] + res["scaling"]["rounds"]:
        turns = (p["agents"] - 1) * p["rounds"] + 1
        for m, r in p["methods"].items():
            assert r["errors"] == 0, r["error_messages"]
            assert r["kvshare_missing"] == 0
            assert r["requests"] == turns * r["workflows"]
            assert r["output_tokens"] == r["requests"] * cfg["output_len"]  # ignore_eos: exact lengths
            for key in ("ttft_s", "ttft_later_s", "e2e_s", "workflow_latency_s"):
                assert r[key]["p50"] > 0 and r[key]["p99"] >= r[key]["p90"] >= r[key]["p50"], (key, r[key])
            for key in ("output_tok_s", "total_tok_s", "makespan_s", "peak_rss_mb", "prompt_tokens", "shared_tokens"):
                assert r[key] > 0, (key, r[key])
            assert r["peak_gpu_mb"] is None or r["peak_gpu_mb"] > 0
            assert r["computed_tokens"] + r["reused_tokens"] == r["prompt_tokens"]
            if m == "nonshared":
                assert r["injected_tokens"] == 0
            elif m == "fullshared":
                assert r["rho_injected"] > 0.3 and r["rho"] >= r["rho_injected"]
        assert p["ratios"]["nonshared"]["ttft_s.p50"] == 1.0
        assert p["ratios"]["fullshared"]["ttft_s.p50"] > 0
        assert p["ratios"]["fullshared"]["computed_tokens"] < 1.0
