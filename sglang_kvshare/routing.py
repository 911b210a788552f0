"""Workflow affinity behind SGLang's router (``smg``): the routing-key header of an annotated request.

The router pins requests by a header, never by a JSON field of the body: with
``--routing-key-override`` (what ``sglang_kvshare.launch_router`` starts it with) every request
that carries ``X-SMG-Routing-Key`` goes to the worker that key was first placed on (by the
router's default policy), and requests without it keep that default policy. A workflow's KV
sources live in one worker's memory, so every request of a workflow must carry the workflow id in
this header. Our clients (``workflows.transport.http_sender``, ``frontend.KVShareEndpoint``) add
it from the ``kvshare.workflow`` of the body; other clients add ``routing_headers(payload)``
(or, in the ``openai`` client, ``extra_headers={"X-SMG-Routing-Key": workflow}``).
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional

from sglang_kvshare.segments.wire import KEY

# The router's own routing-key header (smg and sglang-router; header names are case-insensitive).
ROUTING_KEY_HEADER = "X-SMG-Routing-Key"


def workflow_of(payload: Mapping[str, Any]) -> Optional[str]:
    """``kvshare.workflow`` of a /generate or chat body (None when it has no usable one)."""
    kv = payload.get(KEY) if isinstance(payload, Mapping) else None
    if not isinstance(kv, Mapping):
        return None
    workflow = kv.get("workflow")
    if isinstance(workflow, str) and workflow and workflow.isprintable() and workflow.isascii():
        return workflow
    return None  # a malformed workflow: the worker answers 400, whichever worker it is


def routing_headers(payload: Mapping[str, Any]) -> Dict[str, str]:
    """``{ROUTING_KEY_HEADER: workflow}`` for an annotated body, ``{}`` otherwise."""
    workflow = workflow_of(payload)
    return {ROUTING_KEY_HEADER: workflow} if workflow is not None else {}
