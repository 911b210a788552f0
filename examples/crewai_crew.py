"""A CrewAI sequential crew (analyst -> reviewer -> editor) on the real ``crewai`` package, pointed
at the server with nothing but ``base_url`` and an API key of its own per crew run (no header).

CrewAI fills prompt templates: each task's description holds the shared report (``{report}``,
filled by ``kickoff(inputs=...)``), and a task's ``context=[...]`` pastes the earlier tasks'
final answers into its user message ("This is the context you're working with: ..."). Nothing
repeats as a whole message; on a server started with ``--kvshare-auto kvcmas`` the later agents
still reuse the report's KV and the earlier answers' KV, found as repeated token runs.

Run (in the agent frameworks' venv, which ``scripts/setup.sh`` creates)::

    python -m sglang_kvshare.launch_server --kvshare-auto kvcmas --port 30000 &
    .venv-agents/bin/python examples/crewai_crew.py --base-url http://127.0.0.1:30000/v1

Prints one JSON line per crew run: each agent's time to first token (CrewAI's own LLM events: the
call's start to its first streamed chunk), prompt tokens (the response's usage) and answer.
"""

from __future__ import annotations

import os
import uuid
from typing import Optional

os.environ.setdefault("CREWAI_DISABLE_TELEMETRY", "true")
os.environ.setdefault("OTEL_SDK_DISABLED", "true")
os.environ.setdefault("CREWAI_DISABLE_TRACKING", "true")

from crewai import LLM, Agent, Crew, Process, Task  # noqa: E402
from crewai.events import crewai_event_bus  # noqa: E402
from crewai.events.types.llm_events import (  # noqa: E402
    LLMCallCompletedEvent,
    LLMCallStartedEvent,
    LLMStreamChunkEvent,
)

from agent_contexts import app_parser, print_workflows, report  # noqa: E402

ROLES = {
    "analyst": (
        "Warehouse analyst",
        "Answer questions about warehouse reports with the numbers that support them.",
        "You read shipment reports line by line and never guess.",
    ),
    "reviewer": (
        "Report reviewer",
        "Check an analyst's answer against the report and list any errors.",
        "You audit other people's numbers for a living.",
    ),
    "editor": (
        "Editor",
        "Write the corrected final answer briefly.",
        "You turn reviewed drafts into two clear sentences.",
    ),
}
TASKS = {
    "analyst": "Read this report:\n\n{report}\n\nQuestion: {question}\nAnswer it, citing the depots you used.",
    "reviewer": "Here is the report the analyst used:\n\n{report}\n\nCheck the analyst's answer to the question "
    "'{question}' against the report.",
    "editor": "The report:\n\n{report}\n\nWrite the final answer to '{question}' from the reviewed answer.",
}


class Calls:
    """Per LLM call (CrewAI's events, stamped when emitted): start, first chunk, usage."""

    def __init__(self) -> None:
        self.calls: dict[str, dict] = {}

        @crewai_event_bus.on(LLMCallStartedEvent)
        def started(source, event):
            self.calls.setdefault(event.call_id, {})["start"] = event.timestamp

        @crewai_event_bus.on(LLMStreamChunkEvent)
        def chunk(source, event):
            self.calls.setdefault(event.call_id, {}).setdefault("first", event.timestamp)

        @crewai_event_bus.on(LLMCallCompletedEvent)
        def completed(source, event):
            self.calls.setdefault(event.call_id, {})["usage"] = event.usage or {}

    def take(self) -> list[dict]:
        """The calls so far, in order, forgotten."""
        out = [
            {
                "ttft_s": (c["first"] - c["start"]).total_seconds() if "first" in c and "start" in c else None,
                "prompt_tokens": (c.get("usage") or {}).get("prompt_tokens"),
            }
            for c in self.calls.values()
        ]
        self.calls.clear()
        return out


def build_crew(base_url: str, api_key: str, max_tokens: int, headers: Optional[dict] = None) -> Crew:
    llm = LLM(
        model="openai/default",
        base_url=base_url,
        api_key=api_key,
        temperature=0,
        max_tokens=max_tokens,
        stream=True,
        default_headers=headers or None,
    )
    agents = {
        name: Agent(role=role, goal=goal, backstory=story, llm=llm, allow_delegation=False, max_iter=1, verbose=False)
        for name, (role, goal, story) in ROLES.items()
    }
    tasks: list[Task] = []
    for name, description in TASKS.items():
        tasks.append(
            Task(
                description=description,
                expected_output="A short answer with the depots and numbers.",
                agent=agents[name],
                context=list(tasks),
            )
        )
    return Crew(agents=list(agents.values()), tasks=tasks, process=Process.sequential, verbose=False)


def run_crew(
    base_url: str, seed: int, words: int, max_tokens: int, calls: Calls, headers: Optional[dict] = None
) -> dict:
    api_key = f"crew-{seed}-{uuid.uuid4().hex[:8]}"  # one key per crew run: its scope
    text, question = report(seed, words)
    calls.take()
    result = build_crew(base_url, api_key, max_tokens, headers).kickoff(inputs={"report": text, "question": question})
    answers = [t.raw for t in result.tasks_output]
    return {
        "workflow": api_key,
        "agents": [
            {"agent": name, **call, "answer": answer} for name, call, answer in zip(ROLES, calls.take(), answers)
        ],
    }


def main() -> None:
    args = app_parser(__doc__).parse_args()
    calls = Calls()
    print_workflows(
        args, lambda seed, headers: run_crew(args.base_url, seed, args.words, args.max_tokens, calls, headers)
    )


if __name__ == "__main__":
    main()
