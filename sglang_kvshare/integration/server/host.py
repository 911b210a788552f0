"""The contract between the HTTP middleware's parts: ``Host``, what each part reads of the others.

``KVShareMiddleware`` (``middleware.py``) is made of four parts (``AnnotationMixin``,
``PrefillMixin``, ``ChatMixin``, ``AutoMixin``) and is the one ``Host``. The parts' methods take
``self: Host`` and ``RequestShare.owner`` is a ``Host``, so a type checker resolves every name a
part uses against this Protocol and checks that the middleware provides all of it (mypy,
configured in ``pyproject.toml`` and run by ``scripts/test.sh``).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Optional, Protocol, Sequence

from cachetools import FIFOCache

from sglang_kvshare.config import KVShareArgs
from sglang_kvshare.segments import Span, WireSpec
from sglang_kvshare.segments.spec import KVShareAnnotation
from sglang_kvshare.segments.token_index import TokenIndex

if TYPE_CHECKING:
    from sglang_kvshare.integration.server.annotate import OutputTokens
    from sglang_kvshare.integration.server.chat import ChatShare
    from sglang_kvshare.integration.server.share import RequestShare


class Host(Protocol):
    app: Callable[..., Awaitable[None]]  # SGLang's ASGI app
    args: KVShareArgs
    get_tm: Callable[[], Any]  # SGLang's TokenizerManager
    # annotate.py: agents' output tokens; prefills.py: reference caches made, LP rebuilds queued
    outputs: OutputTokens
    referenced: FIFOCache
    rebuilds: FIFOCache
    rebuild_tasks: set[asyncio.Task]
    # auto.py: the scopes' token index, workflows served, workflows warned about
    index: TokenIndex
    seen: FIFOCache
    missing_logged: FIFOCache

    # annotate.py
    def check_method(self, ann: KVShareAnnotation, lora_path: Any) -> None: ...
    def tokenize(self, ann: KVShareAnnotation) -> tuple[list[int], WireSpec]: ...
    def spec(self, ann: KVShareAnnotation, num_tokens: int, spans: Sequence[Span]) -> WireSpec: ...
    def forward_body(self, payload: dict, ann: KVShareAnnotation) -> tuple[WireSpec, dict]: ...
    def body_with(self, payload: dict, input_ids: list[int], wire: WireSpec) -> dict: ...
    def remember(self, ann: KVShareAnnotation, out: Any) -> None: ...

    # prefills.py
    async def prepare(self, ann: KVShareAnnotation, wire: WireSpec, ids: list[int]) -> WireSpec: ...
    async def ensure_references(self, ann: KVShareAnnotation, wire: WireSpec, ids: list[int]) -> WireSpec: ...
    async def await_rebuilds(self, ann: KVShareAnnotation, wire: WireSpec) -> WireSpec: ...
    def queue_rebuild(self, ann: KVShareAnnotation, ids: list[int], out: dict) -> None: ...
    async def rebuild(self, ann: KVShareAnnotation, ids: list[int], out: dict) -> int: ...

    # chat.py
    async def hand_on(self, scope: dict, receive: Any, send: Any, body: dict, share: ChatShare) -> None: ...

    # auto.py
    def note_sources(self, workflow: str, refers_back: bool) -> bool: ...
    def detection(
        self, headers: Any, method: str, messages: Any, user: Any, lora_path: Any
    ) -> Optional[tuple[dict, dict]]: ...
    def detected(
        self, raw: dict, auto: dict, text: str, stock_ids: list[int], starts: Sequence[int]
    ) -> tuple[KVShareAnnotation, WireSpec]: ...
    def message_of(self, text: str, stock_ids: list[int], starts: Sequence[int]) -> list[int]: ...
    def remember_response(self, share: RequestShare, answer: dict) -> None: ...
