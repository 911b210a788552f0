"""A three-agent LangGraph graph (solver -> critic -> final) on the real ``langgraph`` and
``langchain-openai`` packages, pointed at the server with nothing but ``base_url`` and one default
header (``X-KVShare-Workflow``: the workflow's scope, and its routing key behind the router).

Every node is the standard LangGraph pattern: the agent's own system prompt, then the graph's
message history (the user's report and question, the earlier agents' answers), one streamed
``ChatOpenAI`` call. On a server started with ``--kvshare-auto kvcmas`` the critic and the final
agent reuse the report's KV and the earlier answers' KV although nothing in the app marks them;
with ``--annotate`` each node instead passes the hand-written ``kvshare`` annotation (the
comparison of ``benchmarks/agent_apps.py``).

Run (in the agent frameworks' venv, which ``scripts/setup.sh`` creates)::

    python -m sglang_kvshare.launch_server --kvshare-auto kvcmas --port 30000 &
    .venv-agents/bin/python examples/langgraph_agents.py --base-url http://127.0.0.1:30000/v1

Prints one JSON line per workflow: each agent's time to first token (from LangChain's callbacks)
and answer.
"""

from __future__ import annotations

import time
import uuid
from typing import Optional

from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.messages import HumanMessage, SystemMessage
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, MessagesState, StateGraph

from agent_contexts import app_parser, print_workflows, report

ROLES = {
    "solver": "You are the solver. Read the report and answer the question with the numbers that support it.",
    "critic": "You are the critic. Check the solver's answer against the report and point out any mistake.",
    "final": "You write the final answer. Use the report, the solver's answer and the critic's remarks; be brief.",
}
ORDER = ("solver", "critic", "final")


class FirstToken(BaseCallbackHandler):
    """Time to first token of each LangGraph node's model call."""

    def __init__(self) -> None:
        self.start: dict = {}
        self.ttft: dict[str, float] = {}

    def on_chat_model_start(self, serialized, messages, *, run_id, metadata=None, **kw):
        self.start[run_id] = ((metadata or {}).get("langgraph_node"), time.perf_counter())

    def on_llm_new_token(self, token, *, run_id, **kw):
        node, t0 = self.start.get(run_id, (None, None))
        if node is not None and node not in self.ttft:
            self.ttft[node] = time.perf_counter() - t0


def build_graph(
    base_url: str, workflow: str, max_tokens: int, annotate: Optional[str] = None, headers: Optional[dict] = None
):
    llm = ChatOpenAI(
        base_url=base_url,
        api_key="none",
        model="default",
        temperature=0,
        max_tokens=max_tokens,
        streaming=True,
        default_headers={"X-KVShare-Workflow": workflow, **(headers or {})},
    )

    def node(role: str):
        def run(state: MessagesState):
            messages = [SystemMessage(ROLES[role]), *state["messages"]]
            kwargs = {}
            if annotate:  # the hand-annotated graph: message index -> slot
                shared = {1: "report"} | {2 + k: f"out:{r}" for k, r in enumerate(ORDER[: ORDER.index(role)])}
                kwargs["extra_body"] = {
                    "kvshare": {"workflow": workflow, "agent": role, "method": annotate, "shared_messages": shared}
                }
            return {"messages": [llm.invoke(messages, **kwargs)]}

        return run

    graph = StateGraph(MessagesState)
    for role in ORDER:
        graph.add_node(role, node(role))
    graph.add_edge(START, ORDER[0])
    for a, b in zip(ORDER, ORDER[1:]):
        graph.add_edge(a, b)
    graph.add_edge(ORDER[-1], END)
    return graph.compile()


def run_workflow(
    base_url: str,
    seed: int,
    words: int,
    max_tokens: int,
    annotate: Optional[str] = None,
    headers: Optional[dict] = None,
) -> dict:
    workflow = f"langgraph-{seed}-{uuid.uuid4().hex[:8]}"
    text, question = report(seed, words)
    timer = FirstToken()
    state = build_graph(base_url, workflow, max_tokens, annotate, headers).invoke(
        {"messages": [HumanMessage(f"{text}\n\nQuestion: {question}")]}, config={"callbacks": [timer]}
    )
    answers = [m.content for m in state["messages"][1:]]
    return {
        "workflow": workflow,
        "agents": [
            {"agent": role, "ttft_s": timer.ttft.get(role), "answer": answer} for role, answer in zip(ORDER, answers)
        ],
    }


def main() -> None:
    p = app_parser(__doc__)
    p.add_argument("--annotate", metavar="METHOD", help="pass the hand-written kvshare annotation with this method")
    args = p.parse_args()
    print_workflows(
        args,
        lambda seed, headers: run_workflow(args.base_url, seed, args.words, args.max_tokens, args.annotate, headers),
    )


if __name__ == "__main__":
    main()
