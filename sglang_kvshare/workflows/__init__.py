"""Client-side multi-agent workflows: agent roles, topologies and the runner.

Loading benchmark datasets and scoring outputs live in ``benchmarks/`` (``benchmarks.datasets``,
``benchmarks.scoring``, HumanEval's sandbox included).

Nothing here imports SGLang: a workflow talks to the server only through ``send(payload)``
(``http_sender`` for POST /generate).
"""

from sglang_kvshare.workflows.roles import (
    CHAT_FORMATS,
    CHATML,
    FINAL_AGENT,
    PLAIN,
    ChatFormat,
    Role,
    RoleSet,
    get_roles,
    lora_conversation_roles,
    with_lora_adapters,
)
from sglang_kvshare.workflows.runner import SendFn, TaskRecord, TurnRecord, run_task, run_workflow
from sglang_kvshare.workflows.task import Task
from sglang_kvshare.workflows.topology import (
    QUESTION_SLOT,
    TOPOLOGY_NAMES,
    Turn,
    build_payload,
    build_schedule,
    build_segments,
)
from sglang_kvshare.workflows.transport import ServerError, http_sender

__all__ = [
    "CHATML",
    "CHAT_FORMATS",
    "ChatFormat",
    "FINAL_AGENT",
    "PLAIN",
    "QUESTION_SLOT",
    "Role",
    "RoleSet",
    "SendFn",
    "ServerError",
    "TOPOLOGY_NAMES",
    "Task",
    "TaskRecord",
    "Turn",
    "TurnRecord",
    "build_payload",
    "build_schedule",
    "build_segments",
    "get_roles",
    "lora_conversation_roles",
    "http_sender",
    "run_task",
    "run_workflow",
    "with_lora_adapters",
]
