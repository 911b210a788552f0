"""Pure helpers of the serving and stall benchmarks."""

from __future__ import annotations

import pytest

from benchmarks.observe_stall import split_gaps, summary
from benchmarks.serving import steady_throughput


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
    from benchmarks.fidelity import measured_and_warmup_tasks

    tasks, warm = measured_and_warmup_tasks("mmlu", 12, 5, seed=3)
    assert [t.id for t in tasks] == [t.id for t in load_tasks("mmlu", 12, seed=3)]
    assert len(warm) == 5 and not {t.id for t in warm} & {t.id for t in tasks}
    assert measured_and_warmup_tasks("mmlu", 12, 0, seed=3)[1] == []
