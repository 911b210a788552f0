"""Prompt-specialised agents in the SGLang frontend language, sharing KV cache through the server.

Three task agents and a final agent (the MMLU roles of ``sglang_kvshare.workflows``: Knowledgeable
Expert, Wiki Searcher, Critic, FinalRefer; they differ only by system prompt and glue text) answer
one question in a sequential workflow: each agent reads the question (shared slot ``q``) and every
earlier agent's output (shared slot ``out:<agent>``). Each agent turn is one ``@sgl.function``
run against :class:`sglang_kvshare.frontend.KVShareEndpoint`, so the server injects the question's
and the earlier outputs' KV cache instead of prefilling them again.

    python -m sglang_kvshare.launch_server --port 30000 &      # SmolLM2-135M-Instruct on CPU
    python examples/prompt_agents.py --url http://127.0.0.1:30000 [--method fullshared]

Prints one line per agent with its ``meta_info.kvshare`` summary (tokens computed / reused and
each shared segment's mode).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import sglang as sgl

from sglang_kvshare.frontend import KVShareEndpoint, agent_output, agent_role, kvshare_meta, shared
from sglang_kvshare.workflows import QUESTION_SLOT, Role, get_roles

QUESTION = (
    "Question: Which planet in our solar system has the largest number of confirmed moons as of 2023?\n"
    "A) Earth\nB) Mars\nC) Saturn\nD) Mercury"
)


@sgl.function
def agent_turn(s, role: Role, question: str, earlier: Sequence[tuple], max_tokens: int, ignore_eos: bool = False):
    """One agent's turn: its role (system prompt / adapter), the shared question, the earlier
    agents' outputs (shared, each after the agent's own glue text), its closing instruction."""
    s += agent_role(role.name, system_prompt=role.system_prompt, lora_path=role.lora_path)
    user = shared(question, QUESTION_SLOT)
    for source, title, text in earlier:
        if text:  # an empty output has nothing to share
            user += role.glue("You" if source == role.name else title) + agent_output(source, text)
    s += sgl.user(user + role.closing_instruction)
    s += sgl.assistant(sgl.gen("answer", max_tokens=max_tokens, temperature=0, ignore_eos=ignore_eos or None))


def run_workflow(
    endpoint: KVShareEndpoint,
    roles: Sequence[Role],
    question: str = QUESTION,
    max_tokens: int = 48,
    workflow: Optional[str] = None,
    ignore_eos: bool = False,
) -> List[Dict[str, Any]]:
    """Run ``roles`` in order as one workflow (each reads the question and all earlier outputs).
    Returns per agent: ``agent``, ``output``, ``kvshare`` (the response's meta_info.kvshare)."""
    endpoint.new_workflow(workflow)
    results: List[Dict[str, Any]] = []
    for role in roles:
        earlier = [(r["agent"], r["title"], r["output"]) for r in results]
        state = agent_turn.run(
            role=role,
            question=question,
            earlier=earlier,
            max_tokens=max_tokens,
            ignore_eos=ignore_eos,
            backend=endpoint,
        )
        answer = state["answer"]  # waits for the generation; raises on a failed request
        if state.error():
            raise RuntimeError(f"agent {role.name}: {state.error()}")
        results.append(
            {
                "agent": role.name,
                "title": role.title,
                "lora_path": role.lora_path,
                "output": answer,
                "kvshare": kvshare_meta(state.get_meta_info("answer")),
            }
        )
    return results


def summary(result: Dict[str, Any]) -> str:
    """``agent: computed/prompt tokens, reused N; q=injected(45/45<-expert), ...``"""
    kv = result["kvshare"]
    if not kv:
        return f"{result['agent']}: no meta_info.kvshare (is the server sglang_kvshare?)"
    parts = []
    for seg in kv.get("segments", []):
        if seg.get("shared"):
            src = f"<-{seg['source_agent']}" if seg.get("source_agent") else ""
            parts.append(f"{seg['slot']}={seg['mode']}({seg.get('injected_tokens', 0)}/{seg['tokens']}{src})")
    lora = f" [lora {result['lora_path']}]" if result.get("lora_path") else ""
    return (
        f"{result['agent']}{lora}: method {kv.get('method')}, prompt {kv.get('prompt_tokens')}, "
        f"computed {kv.get('computed_tokens')}, reused {kv.get('reused_tokens')}; " + ", ".join(parts)
    )


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:30000", help="a running sglang_kvshare server")
    ap.add_argument("--method", default="fullshared", help="kvshare method (nonshared, fullshared, kvcmas, ...)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument(
        "--chat-template",
        default=None,
        help="SGLang frontend chat template (default: by model path; chatml for SmolLM2)",
    )
    ap.add_argument("--json", action="store_true", help="also print the full results as JSON")
    args = ap.parse_args(argv)

    endpoint = KVShareEndpoint(args.url, method=args.method, chat_template_name=args.chat_template)
    sgl.set_default_backend(endpoint)
    results = run_workflow(endpoint, get_roles("mmlu").roles, max_tokens=args.max_tokens)
    print(f"workflow {endpoint.workflow} on {endpoint.get_model_name()} (method {args.method})")
    for r in results:
        print(" ", summary(r))
    print(f"final answer: {results[-1]['output'].strip()!r}")
    if args.json:
        print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
