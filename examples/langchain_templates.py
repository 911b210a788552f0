"""Prompt-template apps on the real ``langchain-core`` + ``langchain-openai`` packages, pointed at the
server with nothing but ``base_url`` and one default header (``X-KVShare-Workflow``):

- ``--app chain``: a ``ChatPromptTemplate`` chain drafter -> checker -> writer whose user
  templates embed the shared document and the earlier answers inside one larger message each;
- ``--app rag``: a RAG-style pair (researcher, fact checker) that get the same retrieved chunks of
  the workflow's document, the second in another order (its own "reranker").

Nothing repeats as a whole message; on a server started with ``--kvshare-auto kvcmas`` the later
calls still reuse the document's (or each chunk's) KV and the earlier answers', found as repeated
token runs.

Run (in the agent frameworks' venv, which ``scripts/setup.sh`` creates)::

    python -m sglang_kvshare.launch_server --kvshare-auto kvcmas --port 30000 &
    .venv-agents/bin/python examples/langchain_templates.py --app chain --base-url http://127.0.0.1:30000/v1

Prints one JSON line per workflow: each call's time to first token and prompt tokens (LangChain's
callbacks: the model call's start to its first streamed token; the response's usage) and answer.
"""

from __future__ import annotations

import random
import time
import uuid
from typing import Optional

from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_openai import ChatOpenAI

from agent_contexts import app_parser, print_workflows, report

CHAIN = {
    "drafter": (
        "You draft answers from documents.",
        "Document:\n{document}\n\nQuestion: {question}\nDraft an answer citing the depots you used.",
    ),
    "checker": (
        "You check drafts against their source.",
        "Check this draft against the document.\n\nDocument:\n{document}\n\nQuestion: {question}\n"
        "Draft: {drafter}\n\nList any error.",
    ),
    "writer": (
        "You write final answers.",
        "Source document:\n{document}\n\nQuestion: {question}\nDraft: {drafter}\nReview: {checker}\n\n"
        "Write the final answer in two sentences.",
    ),
}
RAG = {
    "researcher": ("You answer from retrieved passages.", "Passages:\n{context}\n\nQuestion: {question}\nAnswer:"),
    "fact_checker": (
        "You verify claims against retrieved passages.",
        "Retrieved passages:\n{context}\n\nClaim to verify: {researcher}\nQuestion: {question}\n"
        "Is the claim supported?",
    ),
}


class Calls(BaseCallbackHandler):
    """Per model call (LangChain's callbacks): start, first streamed token, prompt tokens."""

    def __init__(self) -> None:
        self.calls: dict = {}

    def on_chat_model_start(self, serialized, messages, *, run_id, **kw):
        self.calls[run_id] = {"start": time.perf_counter()}

    def on_llm_new_token(self, token, *, run_id, **kw):
        call = self.calls.get(run_id)
        if call is not None and "ttft_s" not in call:
            call["ttft_s"] = time.perf_counter() - call["start"]

    def on_llm_end(self, response, *, run_id, **kw):
        message = getattr(response.generations[0][0], "message", None)
        usage = getattr(message, "usage_metadata", None) or {}
        self.calls.setdefault(run_id, {})["prompt_tokens"] = usage.get("input_tokens")

    def take(self) -> list[dict]:
        out = [{k: v for k, v in c.items() if k != "start"} for c in self.calls.values()]
        self.calls.clear()
        return out


def chunks(text: str, n: int = 8) -> list[str]:
    """The document cut into ``n`` passages of whole lines."""
    lines = text.splitlines()
    size = -(-len(lines) // n)
    return ["\n".join(lines[i : i + size]) for i in range(0, len(lines), size)]


def run_workflow(
    app: str, base_url: str, seed: int, words: int, max_tokens: int, headers: Optional[dict] = None
) -> dict:
    workflow = f"{app}-{seed}-{uuid.uuid4().hex[:8]}"
    llm = ChatOpenAI(
        base_url=base_url,
        api_key="none",
        model="default",
        temperature=0,
        max_tokens=max_tokens,
        streaming=True,
        stream_usage=True,
        default_headers={"X-KVShare-Workflow": workflow, **(headers or {})},
    )
    document, question = report(seed, words)
    values = {"document": document, "question": question}
    if app == "rag":
        passages = chunks(document)
        order = list(range(len(passages)))
        random.Random(seed).shuffle(order)
        contexts = {"researcher": passages, "fact_checker": [passages[i] for i in order]}
    calls = Calls()
    answers = {}
    for name, (system, template) in (CHAIN if app == "chain" else RAG).items():
        if app == "rag":
            values["context"] = "\n\n".join(f"[{k + 1}] {p}" for k, p in enumerate(contexts[name]))
        chain = ChatPromptTemplate.from_messages([("system", system), ("user", template)]) | llm | StrOutputParser()
        answers[name] = values[name] = chain.invoke(values, config={"callbacks": [calls]})
    return {
        "workflow": workflow,
        "agents": [{"agent": name, **call, "answer": answers[name]} for name, call in zip(answers, calls.take())],
    }


def main() -> None:
    p = app_parser(__doc__)
    p.add_argument("--app", choices=["chain", "rag"], default="chain")
    args = p.parse_args()
    print_workflows(
        args, lambda seed, headers: run_workflow(args.app, args.base_url, seed, args.words, args.max_tokens, headers)
    )


if __name__ == "__main__":
    main()
