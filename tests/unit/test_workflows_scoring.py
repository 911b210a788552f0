"""Per-dataset scorers on hand-written outputs, the HumanEval subprocess runner, Wilson CI."""

import pytest

from benchmarks.scoring import (
    accuracy,
    extract_choice,
    extract_code,
    extract_final_number,
    score_output,
    wilson_interval,
)
from sglang_kvshare.workflows.task import Task


def _mc(reference="C"):
    choices = ("Paris", "London", "Mitochondria", "Rome")
    return Task("mmlu/x", "mmlu", "Question: ...", reference, choices)


@pytest.mark.parametrize(
    "text, letter",
    [
        ("C", "C"),
        ("(B)\nBecause ...", "B"),
        ("**D.**\nreason", "D"),
        ("I think about it.\nThe answer is C.", "C"),
        ("Answer: (A)", "A"),
        ("The Critic says the answer is A, but the correct answer is B", "B"),
        ("B) London is the capital", "B"),
        ("It is the powerhouse, mitochondria.", "C"),
        ("the option (d) fits", "D"),
    ],
)
def test_extract_choice_positive(text, letter):
    assert extract_choice(text, 4, _mc().choices) == letter


@pytest.mark.parametrize("text", ["", "I am not sure.", "A good question, but it depends.", "Answer: All of them", "E"])
def test_extract_choice_negative(text):
    assert extract_choice(text, 4, _mc().choices) is None


def test_score_multiple_choice():
    assert score_output(_mc("C"), "C\nthe organelle").correct
    wrong = score_output(_mc("C"), "A\nParis")
    assert not wrong.correct and wrong.predicted == "A"
    gpqa = Task("gpqa/x", "gpqa", "Question: ...", "B", ("w", "x", "y", "z"))
    assert score_output(gpqa, "The answer is B").correct


@pytest.mark.parametrize(
    "text, number",
    [
        ("She makes 9 * 2 = 18 dollars.\n#### 18", "18"),
        ("3 + 4 = 7 eggs. The answer is 1,200", "1200"),
        ("The answer is $42.50.", "42.50"),
        ("first 3 then 5 then -7", "-7"),
        ("no digits here", None),
    ],
)
def test_extract_final_number(text, number):
    assert extract_final_number(text) == number


def test_score_gsm8k_numeric_comparison():
    task = Task("gsm8k/x", "gsm8k", "Question: ...", "1200")
    assert score_output(task, "so 1,200.00 in total\nThe answer is 1200.0").correct
    assert not score_output(task, "The answer is 1201").correct
    assert not score_output(task, "I cannot solve this").correct


HE_PROMPT = 'from typing import List\n\n\ndef add_all(xs: List[int]) -> int:\n    """Sum xs."""\n'
HE_TEST = "def check(candidate):\n    assert candidate([1, 2, 3]) == 6\n    assert candidate([]) == 0\n"


def _he():
    extra = {"prompt": HE_PROMPT, "test": HE_TEST, "entry_point": "add_all"}
    return Task("HumanEval/x", "humaneval", HE_PROMPT, "    return sum(xs)\n", (), extra)


def test_humaneval_correct_solution_passes():
    full = "Here:\n```python\ndef add_all(xs: List[int]) -> int:\n    return sum(xs)\n```"
    result = score_output(_he(), full)
    assert result.correct, result.detail
    assert result.detail == "passed"
    assert score_output(_he(), "    return sum(xs)\n").correct  # body-only completion


def test_humaneval_wrong_solution_fails():
    result = score_output(_he(), "```python\ndef add_all(xs):\n    return len(xs)\n```")
    assert not result.correct
    assert "AssertionError" in result.detail


def test_humaneval_infinite_loop_times_out():
    from benchmarks.scoring import score_humaneval

    spinning = "```python\ndef add_all(xs):\n    while True:\n        pass\n```"
    result = score_humaneval(_he(), spinning, timeout_s=1.0)
    assert not result.correct
    assert result.detail == "timed out"


def test_humaneval_program_cannot_touch_scorer_process():
    import os

    marker = "KVSHARE_SCORER_MARKER"
    code = f"```python\nimport os\nos.environ['{marker}'] = '1'\ndef add_all(xs):\n    return sum(xs)\n```"
    assert score_output(_he(), code).correct
    assert marker not in os.environ


def test_extract_code_prefers_block_defining_entry_point():
    text = "```python\nimport math\n```\nthen\n```python\ndef add_all(xs):\n    return 1\n```"
    assert extract_code(text, "add_all").startswith("def add_all")
    assert extract_code("```python\ndef add_all(xs):\n    return 1\n", "add_all").startswith("def")


def test_wilson_interval_known_values():
    low, high = wilson_interval(8, 10)
    assert low == pytest.approx(0.4902, abs=1e-4)
    assert high == pytest.approx(0.9433, abs=1e-4)
    assert wilson_interval(0, 0) == (0.0, 1.0)
    low, high = wilson_interval(0, 20)
    assert low == 0.0 and 0.0 < high < 0.2
    with pytest.raises(ValueError):
        wilson_interval(3, 2)


def test_accuracy_summary():
    est = accuracy([True, False, True, True])
    assert (est.num_correct, est.num_total, est.accuracy) == (3, 4, 0.75)
    assert est.ci_low < 0.75 < est.ci_high
