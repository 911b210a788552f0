"""Pure helpers of the serving and stall benchmarks."""

from __future__ import annotations

import json
from dataclasses import fields

import pytest

from benchmarks.client import Percentiles
from benchmarks import frontier as fr
from benchmarks.observe_stall import split_gaps, summary
from benchmarks.serving.cli import parse_args
from benchmarks.serving.point import steady_throughput
from benchmarks.serving.results import CapacityRow, Part, Point, PointResult, merge_parts
from benchmarks.serving.servers import server_groups
from benchmarks.serving.workload import lora_server_args
from sglang_kvshare.testing.workflows import make_roles


def test_steady_throughput_counts_completions_after_the_first():
    assert steady_throughput([10.0, 12.0, 14.0, 20.0]) == pytest.approx(3 / 10.0)
    assert steady_throughput([5.0, 1.0, 3.0]) == pytest.approx(2 / 4.0)  # order does not matter
    assert steady_throughput([4.0]) is None
    assert steady_throughput([]) is None
    assert steady_throughput([2.0, 2.0]) is None


def test_split_gaps_by_overlap_with_a_prefill():
    gaps = [(0.0, 0.1), (0.1, 2.0), (2.0, 2.1), (2.1, 2.9), (2.9, 3.0)]
    prefills = [(0.5, 1.5)]  # POST at 0.5, first token at 1.5: only the second gap holds it
    decode, prefill = split_gaps(gaps, prefills)
    assert prefill == pytest.approx([1.9])
    assert decode == pytest.approx([0.1, 0.1, 0.8, 0.1])
    # touching ends is no overlap
    assert split_gaps([(0.0, 0.5), (1.5, 2.0)], prefills) == (pytest.approx([0.5, 0.5]), [])


def test_summary_flags_stalls_against_the_median():
    s = summary([0.1, 0.1, 0.1, 0.12, 0.9], stall_factor=3.0)
    assert s["n"] == 5 and s["p50_s"] == pytest.approx(0.1) and s["max_s"] == pytest.approx(0.9)
    assert s["stalls"] == 1
    assert summary([], 3.0) == {"n": 0}


def test_fidelity_warmup_tasks_are_other_tasks_and_keep_the_measured_set():
    from benchmarks.datasets import load_tasks
    from benchmarks.fidelity.options import measured_and_warmup_tasks

    tasks, warm = measured_and_warmup_tasks("mmlu", 12, 5, seed=3)
    assert [t.id for t in tasks] == [t.id for t in load_tasks("mmlu", 12, seed=3)]
    assert len(warm) == 5 and not {t.id for t in warm} & {t.id for t in tasks}
    assert measured_and_warmup_tasks("mmlu", 12, 0, seed=3)[1] == []


def test_lora_runs_fullshared_on_a_plain_lora_server_after_the_lr_cache_server():
    args = parse_args(
        [
            "--agent-kind",
            "lora",
            "--methods",
            "nonshared,fullshared,prelr_shared",
            "--server-arg=--max-total-tokens=8192",
        ]
    )
    groups = server_groups(args)
    assert [(n, ms, url) for n, ms, url, _ in groups] == [
        ("lr-cache", ["nonshared", "prelr_shared"], None),
        ("plain-lora", ["fullshared"], None),
    ]
    assert groups[0][3] == list(lora_server_args()) + ["--max-total-tokens=8192"]
    assert "--kvshare-lr-cache" in groups[0][3] and "--kvshare-lr-cache" not in groups[1][3]
    assert groups[1][3] == [a for a in lora_server_args() if a != "--kvshare-lr-cache"] + ["--max-total-tokens=8192"]
    # generated adapters replace the shipped ones, and every one of them fits in a batch
    gen = server_groups(
        parse_args(["--agent-kind", "lora-random", "--methods", "prelr_shared,fullshared"]),
        {f"a{i}": f"/x/a{i}" for i in range(8)},
    )
    for _, _, _, flags in gen:
        paths = flags[flags.index("--lora-paths") + 1 :]
        assert paths == [f"a{i}=/x/a{i}" for i in range(8)]
        assert flags[flags.index("--max-loras-per-batch") + 1] == "9"  # adapters + the base model
    task, final = make_roles(5, "lora-random")
    assert (
        [r.name for r in task] + [final.name]
        == [r.lora_path for r in task] + [final.lora_path]
        == ["a0", "a1", "a2", "a3", "a4"]
    )
    with pytest.raises(SystemExit):
        parse_args(["--agent-kind", "lora-random", "--lora-rank", "0"])
    # prompt agents: one server; an attached LR-cache server needs the plain one's URL for fullshared
    assert [g[0] for g in server_groups(parse_args([]))] == ["main"]
    # one fresh server per method label: fallback variants then learn their own pools and tau
    per = server_groups(
        parse_args(
            ["--methods", "kvcmas+dense,kvcmas+rows64", "--server-per-method", "--server-arg=--max-total-tokens=8192"]
        )
    )
    assert per == [
        ("kvcmas+dense", ["kvcmas+dense"], None, ["--max-total-tokens=8192"]),
        ("kvcmas+rows64", ["kvcmas+rows64"], None, ["--max-total-tokens=8192"]),
    ]
    with pytest.raises(SystemExit):
        parse_args(["--server-per-method", "--url", "http://x:1"])
    with pytest.raises(SystemExit):
        parse_args(["--agent-kind", "lora", "--url", "http://x:1", "--methods", "nonshared,fullshared"])
    attached = server_groups(
        parse_args(
            [
                "--agent-kind",
                "lora",
                "--url",
                "http://x:1",
                "--plain-lora-url",
                "http://y:2",
                "--methods",
                "nonshared,fullshared",
            ]
        )
    )
    assert [(n, url) for n, _, url, _ in attached] == [("lr-cache", "http://x:1"), ("plain-lora", "http://y:2")]


def _blank(cls, **given):
    """An instance of a result dataclass with every field not ``given`` None."""
    return cls(**{f.name: None for f in fields(cls) if f.name not in given}, **given)


def _point(ctx, methods):
    ttft = lambda v: Percentiles(v, v, v, v, 1)  # noqa: E731
    return Point(ctx, 0.0, 3, 1, {m: _blank(PointResult, method=m, ttft_s=ttft(v)) for m, v in methods.items()})


def test_merge_parts_joins_points_and_recomputes_ratios_over_all_servers():
    def part(pts, cap):
        cap = {ctx: {m: _blank(CapacityRow, wf_per_s=v) for m, v in rows.items()} for ctx, rows in cap.items()}
        return Part(tuple(pts), (), cap, {"agents": (), "rounds": ()}, ({"m": 1},))

    a = part(
        [_point(512, {"nonshared": 2.0, "prelr_shared": 0.5}), _point(256, {"nonshared": 1.0})],
        {"512": {"nonshared": 0.1}},
    )
    b = part([_point(512, {"fullshared": 0.4})], {"512": {"fullshared": 0.3}})
    m = merge_parts([a, b]).to_json()
    assert [p["context"] for p in m["qps_sweep"]] == [256, 512]
    p512 = m["qps_sweep"][1]
    assert list(p512["methods"]) == ["nonshared", "prelr_shared", "fullshared"]
    assert p512["ratios"]["fullshared"]["ttft_s.p50"] == pytest.approx(0.2)
    assert p512["ratios"]["prelr_shared"]["ttft_s.p50"] == pytest.approx(0.25)
    assert p512["methods"]["fullshared"]["ttft_s"] == {"p50": 0.4, "p90": 0.4, "p99": 0.4, "mean": 0.4, "n": 1}
    assert "requests_log" not in p512["methods"]["fullshared"] and "saturated" not in p512["methods"]["fullshared"]
    assert m["capacity"]["512"]["fullshared"]["vs_nonshared"] == pytest.approx(3.0)
    assert len(m["timeline"]) == 2
    assert list(a.points[0].methods) == ["nonshared", "prelr_shared"]  # the parts are left as they were


def _fidelity_json(path, tasks, labels):
    summaries = {
        label: {"rho": rho, "kl_mean": kl, "top1_agree": top1, "exact_match": 0.9, "computed_tokens": 100}
        for label, (rho, kl, top1) in labels.items()
    }
    path.write_text(json.dumps({"config": {"tasks": tasks}, "main": summaries}))
    return path


def test_frontier_joins_runs_on_the_same_tasks_by_family(tmp_path):
    a = _fidelity_json(
        tmp_path / "a.json",
        ["mmlu/1", "mmlu/2"],
        {"nonshared": (0.0, 0.0, 1.0), "fullshared": (1.0, 0.02, 0.9), "kvcmas+head4+rho1.0": (0.9, 0.006, 0.99)},
    )
    b = _fidelity_json(
        tmp_path / "b.json",
        ["mmlu/1", "mmlu/2"],
        {"fullshared": (1.0, 0.02, 0.9), "kvcmas+head4": (0.77, 0.003, 1.0), "kvcmas": (0.86, 0.009, 0.96)},
    )
    other = _fidelity_json(tmp_path / "c.json", ["gsm8k/1"], {"kvcmas": (0.8, 0.01, 0.9)})
    groups = fr.load_points([a, b, other])
    points = fr.dedupe(groups[("mmlu/1", "mmlu/2")])
    assert [p.label for p in points] == ["fullshared", "kvcmas+head4+rho1.0", "kvcmas+head4", "kvcmas"]
    assert {p.family for p in points} == {"fullshared", "kvcmas+head4", "kvcmas"}
    assert fr.Point.family_of("droidspeak@rho0.8") == "droidspeak"
    # kvcmas (0.86, 0.009) is beaten by kvcmas+head4+rho1.0 (0.9, 0.006); the others are not
    assert {p.label for p in fr.frontier(points)} == {"fullshared", "kvcmas+head4+rho1.0", "kvcmas+head4"}
    assert "| kvcmas | b.json | 0.860 | 0.0090 | 0.45 |" in fr.markdown(points)


def test_frontier_cli_writes_table_and_plot(tmp_path):
    a = _fidelity_json(tmp_path / "a.json", ["mmlu/1"], {"fullshared": (1.0, 0.02, 0.9), "kvcmas": (0.86, 0.009, 0.96)})
    assert fr.main([str(a), "--out", str(tmp_path / "f"), "--rename", "a.json:kvcmas=kvcmas (paper)"]) == 0
    assert (tmp_path / "f.png").stat().st_size > 0
    assert "| kvcmas (paper) | a.json |" in (tmp_path / "f.md").read_text()
    with pytest.raises(SystemExit):
        fr.main([str(a), "--out", str(tmp_path / "g"), "--families", "nothing"])
    with pytest.raises(SystemExit):
        fr.main([str(a), "--out", str(tmp_path / "g"), "--rename", "kvcmas=x"])
