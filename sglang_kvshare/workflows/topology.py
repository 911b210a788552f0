"""Workflow topologies and the client-side runner that sends each agent turn to the server.

A topology is a schedule: an ordered list of ``Turn``s, each naming the agent and the earlier
turns whose outputs it reads. For every turn the runner builds the agent's trajectory as KVCMAS
eq. 1 lays it out,

    [PF sys_i, PH q, PF glue_0, PH out_0, PF glue_1, PH out_1, ..., PF closing]

sends it through an injected ``send(payload) -> response`` (``http_sender`` POSTs to /generate),
and records the output. The final agent's output is scored by an injected ``score_fn``
(``benchmarks.scoring.score_output`` for the benchmark datasets).

Schedules, for task agents A0, A1, A2 and final agent F (every agent reads ``q``):

- ``sequential``: A0 -> A1 -> A2 -> F; each agent reads all earlier outputs in order.
- ``fan_in``: A0, A1, A2 read only ``q``; F reads out:A0, out:A1, out:A2.
- ``fan_out``: A0 reads ``q``; A1 and A2 each read out:A0 only; F reads out:A0, out:A1, out:A2.
- ``loop``: ``num_rounds`` passes of A0 -> A1 -> A2; each turn reads the latest output of every
  task agent produced so far (its own earlier output included), oldest first; F then reads the
  latest output of each task agent. With ``num_rounds=1`` this equals ``sequential``.

Invariant: a trajectory holds at most one output per agent, so the slot ``out:<agent>`` names one
text within a request. Turns are sent one at a time in schedule order.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from sglang_kvshare.workflows.roles import CHATML, ChatFormat, Role, RoleSet
from sglang_kvshare.workflows.task import Task

SendFn = Callable[[Dict[str, Any]], Dict[str, Any]]
ScoreFn = Callable[[Task, str], Any]

QUESTION_SLOT = "q"
TOPOLOGY_NAMES: Tuple[str, ...] = ("sequential", "fan_in", "fan_out", "loop")


def out_slot(agent: str) -> str:
    """Slot name of ``agent``'s output when later agents read it as shared context."""
    return f"out:{agent}"


# ----------------------------------------------------------------------------- schedules


@dataclass(frozen=True)
class Turn:
    """One agent request. ``reads``: indices of earlier turns whose outputs this agent reads, in
    trajectory order; ``round``: 0-based pass (non-zero only in ``loop``)."""

    agent: str
    reads: Tuple[int, ...] = ()
    round: int = 0


def _latest_per_agent(turns: Sequence[Turn], agents: Sequence[str]) -> Tuple[int, ...]:
    latest: Dict[str, int] = {}
    for i, t in enumerate(turns):
        if t.agent in agents:
            latest[t.agent] = i
    return tuple(sorted(latest.values()))


def build_schedule(
    topology: str, task_agents: Sequence[str], final_agent: str, num_rounds: int = 2
) -> List[Turn]:
    """Turns of ``topology`` (see module docstring); the last turn is always ``final_agent``.
    ``num_rounds`` is used by ``loop`` only."""
    task_agents = list(task_agents)
    if not task_agents:
        raise ValueError("a workflow needs at least one task agent")
    turns: List[Turn] = []
    if topology == "sequential":
        for i, agent in enumerate(task_agents):
            turns.append(Turn(agent, tuple(range(i))))
    elif topology == "fan_in":
        turns = [Turn(agent) for agent in task_agents]
    elif topology == "fan_out":
        turns = [Turn(task_agents[0])] + [Turn(agent, (0,)) for agent in task_agents[1:]]
    elif topology == "loop":
        if num_rounds < 1:
            raise ValueError(f"num_rounds must be >= 1, got {num_rounds}")
        for r in range(num_rounds):
            for agent in task_agents:
                turns.append(Turn(agent, _latest_per_agent(turns, task_agents), r))
    else:
        raise ValueError(f"unknown topology {topology!r}; choose from {TOPOLOGY_NAMES}")
    turns.append(Turn(final_agent, _latest_per_agent(turns, task_agents), turns[-1].round))
    return turns


# ----------------------------------------------------------------------------- segments


def build_segments(
    role: Role,
    question: str,
    read_outputs: Sequence[Tuple[str, str, str]],
    chat_format: ChatFormat = CHATML,
) -> List[Dict[str, Any]]:
    """The agent's trajectory as protocol segments.

    read_outputs: ``(source_agent, source_title, text)`` in trajectory order; an empty ``text`` is
        left out with its glue (an empty shared segment has no tokens to share).
    Returns ``[PF sys, PH q, (PF glue, PH out:<source>)*, PF closing]``; PF segments are
    ``{"text", "shared": False}``, PH segments ``{"text", "shared": True, "slot"}``. Shared texts
    are passed through byte-exact.
    """
    segments: List[Dict[str, Any]] = [
        {"text": chat_format.system_open + role.system_prompt + chat_format.user_open,
         "shared": False},
        {"text": question, "shared": True, "slot": QUESTION_SLOT},
    ]
    seen_slots = {QUESTION_SLOT}
    for source_agent, source_title, text in read_outputs:
        if not text:
            continue
        slot = out_slot(source_agent)
        if slot in seen_slots:
            raise ValueError(f"slot {slot!r} appears twice in the trajectory of {role.name!r}")
        seen_slots.add(slot)
        title = "You" if source_agent == role.name else source_title
        segments.append({"text": role.glue(title), "shared": False})
        segments.append({"text": text, "shared": True, "slot": slot})
    closing = role.closing_instruction + chat_format.assistant_open
    if closing:
        segments.append({"text": closing, "shared": False})
    return segments


def build_payload(
    role: Role,
    segments: List[Dict[str, Any]],
    workflow_id: str,
    method: str,
    max_new_tokens: int,
    temperature: float = 0.0,
) -> Dict[str, Any]:
    """The POST /generate body of one agent turn; ``lora_path`` only for adapter roles."""
    payload: Dict[str, Any] = {
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": temperature},
        "kvshare": {
            "workflow": workflow_id,
            "agent": role.name,
            "method": method,
            "segments": segments,
        },
    }
    if role.lora_path is not None:
        payload["lora_path"] = role.lora_path
    return payload


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
    schedule = build_schedule(
        topology, [r.name for r in roles.task_roles], roles.final_role.name, num_rounds
    )
    outputs: List[str] = []
    turn_records: List[TurnRecord] = []
    for index, turn in enumerate(schedule):
        role = role_by_name[turn.agent]
        read_outputs = [
            (schedule[j].agent, role_by_name[schedule[j].agent].title, outputs[j])
            for j in turn.reads
        ]
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
            prompt_tokens + completion_tokens
            if prompt_tokens is not None and completion_tokens is not None
            else None
        )
        outputs.append(text)
        turn_records.append(
            TurnRecord(
                index=index,
                agent=turn.agent,
                round=turn.round,
                read_slots=[out_slot(schedule[j].agent) for j in turn.reads if outputs[j]],
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
