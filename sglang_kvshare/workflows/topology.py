"""Workflow topologies and the request of each agent turn.

A topology is a schedule: an ordered list of ``Turn``s, each naming the agent and the earlier
turns whose outputs it reads. For every turn the agent's trajectory is laid out as KVCMAS eq. 1
does,

    [PF sys_i, PH q, PF glue_0, PH out_0, PF glue_1, PH out_1, ..., PF closing]

(``build_segments``) and wrapped into a POST /generate body (``build_payload``). Sending the
turns and recording their outputs is ``workflows.runner``.

Schedules, for task agents A0, A1, A2 and final agent F (every agent reads ``q``):

- ``sequential``: A0 -> A1 -> A2 -> F; each agent reads all earlier outputs in order.
- ``fan_in``: A0, A1, A2 read only ``q``; F reads out:A0, out:A1, out:A2.
- ``fan_out``: A0 reads ``q``; A1 and A2 each read out:A0 only; F reads out:A0, out:A1, out:A2.
- ``loop``: ``num_rounds`` passes of A0 -> A1 -> A2; each turn reads the latest output of every
  task agent produced so far (its own earlier output included), oldest first; F then reads the
  latest output of each task agent. With ``num_rounds=1`` this equals ``sequential``.

Invariant: a trajectory holds at most one output per agent, so the slot ``out:<agent>`` names one
text within a request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Sequence, Tuple

from sglang_kvshare.methods import method_variant
from sglang_kvshare.segments.wire import output_slot
from sglang_kvshare.workflows.roles import CHATML, ChatFormat, Role

QUESTION_SLOT = "q"
TOPOLOGY_NAMES: Tuple[str, ...] = ("sequential", "fan_in", "fan_out", "loop")


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


def build_schedule(topology: str, task_agents: Sequence[str], final_agent: str, num_rounds: int = 2) -> List[Turn]:
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
    role: Role, question: str, read_outputs: Sequence[Tuple[str, str, str]], chat_format: ChatFormat = CHATML
) -> List[Dict[str, Any]]:
    """The agent's trajectory as protocol segments.

    read_outputs: ``(source_agent, source_title, text)`` in trajectory order; an empty ``text`` is
        left out with its glue (an empty shared segment has no tokens to share).
    Returns ``[PF sys, PH q, (PF glue, PH out:<source>)*, PF closing]``; PF segments are
    ``{"text", "shared": False}``, PH segments ``{"text", "shared": True, "slot"}``. Shared texts
    are passed through byte-exact.
    """
    segments: List[Dict[str, Any]] = [
        {"text": chat_format.system_open + role.system_prompt + chat_format.user_open, "shared": False},
        {"text": question, "shared": True, "slot": QUESTION_SLOT},
    ]
    seen_slots = {QUESTION_SLOT}
    for source_agent, source_title, text in read_outputs:
        if not text:
            continue
        slot = output_slot(source_agent)
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
    """The POST /generate body of one agent turn; ``lora_path`` only for adapter roles.
    ``method`` may name a variant (``methods.method_variant``: ``kvcmas+rows64``)."""
    method, variant = method_variant(method)
    payload: Dict[str, Any] = {
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": temperature},
        "kvshare": {"workflow": workflow_id, "agent": role.name, "method": method, "segments": segments, **variant},
    }
    if role.lora_path is not None:
        payload["lora_path"] = role.lora_path
    return payload
