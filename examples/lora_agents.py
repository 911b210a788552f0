"""LoRA-specialised agents in the SGLang frontend language: one adapter per role, shared KV cache.

The three role adapters trained for this repository (``adapters/smollm2-{solver,critic,final}-qv-r8``,
see docs/adapters.md) run a GSM8K-style workflow solver -> critic -> final. Each agent turn is an
``@sgl.function`` whose ``agent_role(..., lora_path=<adapter name>)`` makes the request carry
``lora_path``; the question (slot ``q``) and earlier outputs (``out:<agent>``) are shared segments.
System prompts and user layout follow the adapters' training data (scripts/train_adapters.py).

    python -m sglang_kvshare.launch_server --port 30000 --enable-lora --lora-backend torch_native \\
        --lora-paths solver=adapters/smollm2-solver-qv-r8 critic=adapters/smollm2-critic-qv-r8 \\
                     final=adapters/smollm2-final-qv-r8 &
    python examples/lora_agents.py --url http://127.0.0.1:30000

The example first checks that the server serves the three adapters and stops with a clear error
otherwise. On the CPU, SGLang 0.5.23's LoRA layers allocate pinned host memory, which fails
without an accelerator ("pin_memory=True requires a CUDA or other accelerator backend"); the
plugin drops the pinning when there is no CUDA (``cpu_shims.unpin_lora``), and
``--lora-backend torch_native`` is the backend that runs on the CPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import requests

from examples.prompt_agents import run_workflow, summary
from sglang_kvshare.frontend import KVShareEndpoint
from sglang_kvshare.workflows import Role

REPO = Path(__file__).resolve().parents[1]
ADAPTERS = {name: REPO / "adapters" / f"smollm2-{name}-qv-r8" for name in ("solver", "critic", "final")}
LORA_FLAGS = [
    "--enable-lora",
    "--lora-backend",
    "torch_native",
    "--lora-paths",
    *[f"{name}={path}" for name, path in ADAPTERS.items()],
]

# As the adapters were trained (scripts/train_adapters.py SYSTEM_PROMPTS and user layout).
LORA_ROLES = (
    Role(
        name="solver",
        title="Solver",
        lora_path="solver",
        system_prompt="You are a math solver. Solve the problem step by step and end with '#### <answer>'.",
    ),
    Role(
        name="critic",
        title="Critic",
        lora_path="critic",
        glue_template="\n\nProposed solution:\n",
        system_prompt="You are a critic. Check the proposed solution and give a verdict.",
    ),
    Role(
        name="final",
        title="Final",
        lora_path="final",
        glue_template="\n\n{source} wrote:\n",
        system_prompt="You are the final answer agent. Read the solution and the check, then state the final answer.",
    ),
)
QUESTION = (
    "Question: A baker makes 24 muffins in the morning and 18 in the afternoon. She sells 30 of "
    "them and gives 4 to her neighbour. How many muffins does she have left?"
)


class LoRANotServed(RuntimeError):
    """The server does not serve the role adapters (not started with them, or no LoRA support)."""


def check_adapters(url: str, names: Sequence[str] = tuple(ADAPTERS)) -> None:
    """Raise :class:`LoRANotServed` unless the server at ``url`` has LoRA on with ``names`` loaded."""
    info = requests.get(url.rstrip("/") + "/get_server_info", timeout=30).json()
    lora_paths = info.get("lora_paths") or {}
    if isinstance(lora_paths, list):  # list of "name=path" strings or {"lora_name": ...} dicts
        served = {p.get("lora_name") if isinstance(p, dict) else str(p).split("=")[0] for p in lora_paths}
    else:
        served = set(lora_paths)
    missing = [n for n in names if n not in served]
    if not info.get("enable_lora") or missing:
        raise LoRANotServed(
            f"server {url} does not serve the role adapters {missing or list(names)} "
            f"(enable_lora={info.get('enable_lora')}, lora_paths={lora_paths!r}); start it with " + " ".join(LORA_FLAGS)
        )


def run_lora_workflow(
    url: str, method: str = "fullshared", max_tokens: int = 48, workflow: Optional[str] = None
) -> List[Dict[str, Any]]:
    check_adapters(url)
    endpoint = KVShareEndpoint(url, method=method, chat_template_name="chatml")
    return run_workflow(endpoint, LORA_ROLES, question=QUESTION, max_tokens=max_tokens, workflow=workflow)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:30000", help="a running sglang_kvshare server with the adapters")
    ap.add_argument("--method", default="fullshared")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    try:
        results = run_lora_workflow(args.url, args.method, args.max_tokens)
    except LoRANotServed as e:
        sys.exit(f"error: {e}")
    print(f"LoRA workflow (method {args.method})")
    for r in results:
        print(" ", summary(r))
    print(f"final answer: {results[-1]['output'].strip()!r}")
    if args.json:
        print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
