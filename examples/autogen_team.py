"""An AutoGen round-robin team (analyst -> reviewer -> editor) on the real ``autogen-agentchat`` and
``autogen-ext[openai]`` packages, pointed at the server with nothing but ``base_url`` and one
default header (``X-KVShare-Workflow``).

Each agent has its own system message; AutoGen sends every agent the task and the earlier agents'
messages (as ``user`` messages with their ``name``). On a server started with
``--kvshare-auto kvcmas`` the later agents reuse the task's KV and the earlier answers' KV
without any change to the team.

Run (in the agent frameworks' venv, which ``scripts/setup.sh`` creates)::

    python -m sglang_kvshare.launch_server --kvshare-auto kvcmas --port 30000 &
    .venv-agents/bin/python examples/autogen_team.py --base-url http://127.0.0.1:30000/v1

Prints one JSON line per team run: each agent's time to first token (from the streamed events:
the previous agent's last message to this agent's first chunk) and answer.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Optional

from autogen_agentchat.agents import AssistantAgent
from autogen_agentchat.conditions import MaxMessageTermination
from autogen_agentchat.messages import ModelClientStreamingChunkEvent, TextMessage
from autogen_agentchat.teams import RoundRobinGroupChat
from autogen_ext.models.openai import OpenAIChatCompletionClient

from agent_contexts import app_parser, print_workflows, report

ROLES = {
    "analyst": "You are the analyst. Answer the question from the report, citing the depots you used.",
    "reviewer": "You are the reviewer. Check the analyst's answer against the report and list any errors.",
    "editor": "You are the editor. Write the corrected final answer in two sentences.",
}
MODEL_INFO = {
    "vision": False,
    "function_calling": True,
    "json_output": True,
    "family": "unknown",
    "structured_output": True,
}


async def run_team(base_url: str, seed: int, words: int, max_tokens: int, headers: Optional[dict] = None) -> dict:
    workflow = f"autogen-{seed}-{uuid.uuid4().hex[:8]}"
    client = OpenAIChatCompletionClient(
        model="default",
        base_url=base_url,
        api_key="none",
        model_info=MODEL_INFO,
        temperature=0,
        max_tokens=max_tokens,
        default_headers={"X-KVShare-Workflow": workflow, **(headers or {})},
    )
    agents = [
        AssistantAgent(name, model_client=client, system_message=prompt, model_client_stream=True)
        for name, prompt in ROLES.items()
    ]
    team = RoundRobinGroupChat(agents, termination_condition=MaxMessageTermination(len(agents) + 1))
    text, question = report(seed, words)
    ttft: dict[str, float] = {}
    answers: dict[str, str] = {}
    last = time.perf_counter()
    async for event in team.run_stream(task=f"{text}\n\nQuestion: {question}"):
        now = time.perf_counter()
        if isinstance(event, ModelClientStreamingChunkEvent) and event.source not in ttft:
            ttft[event.source] = now - last
        elif isinstance(event, TextMessage):
            answers.setdefault(event.source, event.content)
            last = now
    await client.close()
    return {
        "workflow": workflow,
        "agents": [{"agent": name, "ttft_s": ttft.get(name), "answer": answers.get(name)} for name in ROLES],
    }


def main() -> None:
    args = app_parser(__doc__).parse_args()
    print_workflows(
        args, lambda seed, headers: asyncio.run(run_team(args.base_url, seed, args.words, args.max_tokens, headers))
    )


if __name__ == "__main__":
    main()
