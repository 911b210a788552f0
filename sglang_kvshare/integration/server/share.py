"""One annotated request on its way through SGLang (HTTP process): what the middleware leaves in
its ASGI scope for the ``generate_request`` hook (``generate.py``), which runs the method's
prefills, keeps the request's ``kvshare`` record and remembers the agent's output tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from sglang_kvshare.methods import get_method
from sglang_kvshare.segments import WireSpec
from sglang_kvshare.segments.spec import KVShareAnnotation
from sglang_kvshare.segments.wire import KEY

if TYPE_CHECKING:
    from sglang_kvshare.integration.server.host import Host


@dataclass
class RequestShare:
    owner: Host  # the middleware: its output memory, tokenisation and prefills
    ann: Optional[KVShareAnnotation] = None
    input_ids: Optional[list[int]] = None
    wire: Optional[WireSpec] = None
    record: Optional[dict] = None  # the latest ``meta_info.kvshare``
    # automatic detection (``--kvshare-auto``): scope, agent, detected and dropped pieces; the
    # record carries it as ``auto``
    auto: Optional[dict] = None
    sources_missing: bool = False  # it refers to earlier turns this worker never served

    def with_notes(self, record: dict) -> dict:
        """The scheduler's ``record`` with what the HTTP process adds: ``auto`` and
        ``sources_missing``."""
        notes: dict[str, Any] = {"auto": self.auto} if self.auto is not None else {}
        if self.sources_missing:
            notes["sources_missing"] = True
        return {**record, **notes} if notes else record

    def annotated(self) -> tuple[KVShareAnnotation, WireSpec, list[int]]:
        """The annotation, spec and token ids (set when the request is built, a chat request's once
        SGLang rendered its prompt: ``ChatShare.annotate``)."""
        if self.ann is None or self.wire is None or self.input_ids is None:
            raise RuntimeError("kvshare: the request's annotation is not complete yet")
        return self.ann, self.wire, self.input_ids

    async def prepare(self) -> WireSpec:
        """The spec to send, after the prefills the method needs."""
        ann, wire, ids = self.annotated()
        return await self.owner.prepare(ann, wire, ids)

    def finish(self, answer: dict, lora_path) -> None:
        """The first choice's answer is complete: remember the agent's output tokens; ReBaseShared
        LP queues the adapter-free rebuild of an adapted turn."""
        ann, _, ids = self.annotated()
        self.owner.remember(ann, answer)
        if self.auto is not None:
            self.owner.remember_response(self, answer)
        if get_method(ann.method).lr_sharing == "rebase_lp" and lora_path is not None:
            self.owner.queue_rebuild(ann, ids, answer)


def in_scope(scope: dict, share: RequestShare) -> dict:
    """``scope`` with ``share`` in its state (a copy; the state dict is new too)."""
    return dict(scope, state={**scope.get("state", {}), KEY: share})


def share_of(raw_request) -> Optional[RequestShare]:
    """The share the middleware put into a request's ASGI scope (None: not annotated)."""
    return None if raw_request is None else (raw_request.scope.get("state") or {}).get(KEY)
