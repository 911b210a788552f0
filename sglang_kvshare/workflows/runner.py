"""The client-side workflow runner: sends each turn of a topology to the server and records it.

For every turn of ``topology.build_schedule`` the runner builds the agent's request
(``topology.build_segments``, ``topology.build_payload``), sends it through an injected
``send(payload) -> response`` (``http_sender`` POSTs to /generate) and records the output and the
server's ``kvshare`` metadata (``TurnRecord``). The final agent's output is scored by an injected
``score_fn`` (``benchmarks.scoring.score_output`` for the benchmark datasets) into the task's
``TaskRecord``. Turns are sent one at a time in schedule order.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

from sglang_kvshare.workflows.roles import CHATML, ChatFormat, RoleSet
from sglang_kvshare.workflows.task import Task
from sglang_kvshare.segments.wire import output_slot
from sglang_kvshare.workflows.topology import build_payload, build_schedule, build_segments

SendFn = Callable[[Dict[str, Any]], Dict[str, Any]]
ScoreFn = Callable[[Task, str], Any]


# ----------------------------------------------------------------------------- records


@dataclass
class TurnRecord:
    """One sent turn. ``kvshare``: the server's ``meta_info.kvshare`` as returned ({} if absent).
    ``prompt_tokens``: from ``kvshare.prompt_tokens`` (else ``meta_info.prompt_tokens``);
    ``trajectory_len = prompt_tokens + completion_tokens`` (None if either is unknown).
    ``latency_s``: wall time of ``send`` as seen by the client."""

    index: int
    agent: str
    round: int
    read_slots: List[str]
    segments: List[Dict[str, Any]]
    output_text: str
    kvshare: Dict[str, Any]
    prompt_tokens: Optional[int]
    completion_tokens: Optional[int]
    trajectory_len: Optional[int]
    latency_s: float


@dataclass
class TaskRecord:
    """One task run through one workflow. ``score`` judges ``final_output`` (the last turn's text;
    None when the run had no ``score_fn``).
    Token totals sum ``kvshare`` fields over turns (None when any turn lacks the field)."""

    task_id: str
    dataset: str
    topology: str
    method: str
    workflow_id: str
    reference: str
    final_output: str
    score: Any
    turns: List[TurnRecord] = field(default_factory=list)
    total_prompt_tokens: Optional[int] = None
    total_reused_tokens: Optional[int] = None
    total_computed_tokens: Optional[int] = None

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


def _sum_field(kvshares: Sequence[Dict[str, Any]], key: str) -> Optional[int]:
    values = [kv.get(key) for kv in kvshares]
    if not values or any(v is None for v in values):
        return None
    return int(sum(values))


# ----------------------------------------------------------------------------- runner


def run_task(
    task: Task,
    roles: RoleSet,
    topology: str,
    method: str,
    send: SendFn,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    num_rounds: int = 2,
    chat_format: ChatFormat = CHATML,
    workflow_id: Optional[str] = None,
    score_fn: Optional[ScoreFn] = None,
) -> TaskRecord:
    """Run every turn of ``topology`` for ``task`` through ``send`` and score the final output
    with ``score_fn`` (when given).

    ``send`` receives the payload of ``build_payload`` and must return the server's JSON
    (``{"text": str, "meta_info": {...}}``); its exceptions propagate. ``workflow_id`` defaults to
    ``"wf:<task.id>"`` and must be unique per task run.
    """
    if task.dataset != roles.dataset:
        raise ValueError(f"task {task.id!r} is {task.dataset!r} but roles are {roles.dataset!r}")
    workflow_id = workflow_id or f"wf:{task.id}"
    role_by_name = roles.by_name()
    schedule = build_schedule(topology, [r.name for r in roles.task_roles], roles.final_role.name, num_rounds)
    outputs: List[str] = []
    turn_records: List[TurnRecord] = []
    for index, turn in enumerate(schedule):
        role = role_by_name[turn.agent]
        read_outputs = [(schedule[j].agent, role_by_name[schedule[j].agent].title, outputs[j]) for j in turn.reads]
        segments = build_segments(role, task.question, read_outputs, chat_format)
        payload = build_payload(role, segments, workflow_id, method, max_new_tokens, temperature)
        start = time.perf_counter()
        response = send(payload)
        latency_s = time.perf_counter() - start
        text = response["text"]
        meta = response.get("meta_info") or {}
        kvshare = meta.get("kvshare") or {}
        prompt_tokens = kvshare.get("prompt_tokens", meta.get("prompt_tokens"))
        completion_tokens = meta.get("completion_tokens")
        trajectory_len = (
            prompt_tokens + completion_tokens if prompt_tokens is not None and completion_tokens is not None else None
        )
        outputs.append(text)
        turn_records.append(
            TurnRecord(
                index=index,
                agent=turn.agent,
                round=turn.round,
                read_slots=[output_slot(schedule[j].agent) for j in turn.reads if outputs[j]],
                segments=segments,
                output_text=text,
                kvshare=kvshare,
                prompt_tokens=prompt_tokens,
                completion_tokens=completion_tokens,
                trajectory_len=trajectory_len,
                latency_s=latency_s,
            )
        )
    kvshares = [t.kvshare for t in turn_records]
    return TaskRecord(
        task_id=task.id,
        dataset=task.dataset,
        topology=topology,
        method=method,
        workflow_id=workflow_id,
        reference=task.reference,
        final_output=outputs[-1],
        score=score_fn(task, outputs[-1]) if score_fn is not None else None,
        turns=turn_records,
        total_prompt_tokens=_sum_field(kvshares, "prompt_tokens"),
        total_reused_tokens=_sum_field(kvshares, "reused_tokens"),
        total_computed_tokens=_sum_field(kvshares, "computed_tokens"),
    )


def run_workflow(
    tasks: Sequence[Task],
    roles: RoleSet,
    topology: str,
    method: str,
    send: SendFn,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    num_rounds: int = 2,
    chat_format: ChatFormat = CHATML,
    workflow_prefix: str = "wf",
    score_fn: Optional[ScoreFn] = None,
) -> List[TaskRecord]:
    """``run_task`` for each task in order; task ``t`` runs as workflow
    ``"<workflow_prefix>:<t.id>"``. Records are JSON-serialisable via ``to_dict``."""
    return [
        run_task(
            task,
            roles,
            topology,
            method,
            send,
            max_new_tokens,
            temperature=temperature,
            num_rounds=num_rounds,
            chat_format=chat_format,
            workflow_id=f"{workflow_prefix}:{task.id}",
            score_fn=score_fn,
        )
        for task in tasks
    ]
