"""The role adapters are trained under the prompt they serve: ``scripts/train_adapters.py`` lays
out each role's training prompt exactly as the workflow runner sends that role's turn."""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path

import pytest

from sglang_kvshare.workflows import lora_conversation_roles, run_task
from sglang_kvshare.workflows.task import Task

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "train_adapters.py"


@pytest.fixture(scope="module")
def train():
    spec = importlib.util.spec_from_file_location("train_adapters", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


ITEM_STEPS = "Lily = 9 + 7 = 16 insects\nLily found 16 insects."


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_training_prompts_are_the_served_workflow_prompts(train, seed):
    item = train.Item(7, "How many insects did Lily find?", ITEM_STEPS, "16")
    examples = {role: train.role_example(role, item, random.Random(f"{seed}:{role}")) for role in train.ROLES}
    solver_text = examples["solver"][1]
    critic_text = examples["critic"][1]
    assert solver_text.endswith("#### 16") and critic_text.startswith("Check: Lily found 16")
    assert examples["final"][1] == "#### 16"

    for role in ("critic", "final"):
        # Replay the workflow with the earlier agents replying what this role's training prompt
        # shows them, and capture the segments the runner sends to ``role``.
        shown = examples[role][0]
        proposed = next(text for text in shown if "\n#### " in text)
        verdict = next((text for text in shown if text.startswith("Check: ")), critic_text)
        replies = {"solver": proposed, "critic": verdict, "final": "#### 16"}
        sent = {}

        def send(payload):
            agent = payload["kvshare"]["agent"]
            sent[agent] = [seg["text"] for seg in payload["kvshare"]["segments"]]
            assert payload["lora_path"] == agent
            return {"text": replies[agent], "meta_info": {}}

        task = Task(id="gsm8k/7", dataset="gsm8k", question=f"Question: {item.question}", reference="16")
        run_task(task, lora_conversation_roles(), "sequential", "nonshared", send, 32)
        assert sent[role] == shown
        assert sent["solver"] == examples["solver"][0]


def test_critic_and_final_see_corrupted_answers_for_about_half_the_items(train):
    items = [train.Item(i, f"q{i}", "x = 2 + 3\nx = 5", "5") for i in range(200)]
    rng = random.Random(0)
    critic = [train.role_example("critic", it, rng)[1] for it in items]
    wrong = sum("incorrect, the answer is 5." in reply for reply in critic)
    assert 70 <= wrong <= 130
    assert all(reply.startswith("Check: x = 5 Verdict: ") for reply in critic)
