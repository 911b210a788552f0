"""Client-side multi-agent workflows: benchmark tasks, agent roles, topologies and scoring.

Nothing here imports SGLang: a workflow talks to the server only through ``send(payload)``
(``http_sender`` for POST /generate).
"""

from sglang_kvshare.workflows.datasets import DATASET_NAMES, Task, load_tasks
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
from sglang_kvshare.workflows.scoring import (
    AccuracyEstimate,
    Score,
    accuracy,
    score_output,
    wilson_interval,
)
from sglang_kvshare.workflows.topology import (
    QUESTION_SLOT,
    TOPOLOGY_NAMES,
    SendFn,
    ServerError,
    TaskRecord,
    Turn,
    TurnRecord,
    build_payload,
    build_schedule,
    build_segments,
    http_sender,
    out_slot,
    run_task,
    run_workflow,
)

__all__ = [
    "AccuracyEstimate",
    "CHATML",
    "CHAT_FORMATS",
    "ChatFormat",
    "DATASET_NAMES",
    "FINAL_AGENT",
    "PLAIN",
    "QUESTION_SLOT",
    "Role",
    "RoleSet",
    "Score",
    "SendFn",
    "ServerError",
    "TOPOLOGY_NAMES",
    "Task",
    "TaskRecord",
    "Turn",
    "TurnRecord",
    "accuracy",
    "build_payload",
    "build_schedule",
    "build_segments",
    "get_roles",
    "lora_conversation_roles",
    "http_sender",
    "load_tasks",
    "out_slot",
    "run_task",
    "run_workflow",
    "score_output",
    "wilson_interval",
]
