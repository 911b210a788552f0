"""The HTTP process's layer: an ASGI middleware on SGLang's own FastAPI app for annotated requests.

``GET /server_info`` gets the automatic detection's index sizes (``kvshare_auto_index``). For a
``POST /generate`` whose JSON body has a ``kvshare`` object, it validates and tokenises the
annotation (``annotate.py``; HTTP 400 naming the defect) and forwards the request to SGLang as
``input_ids``, with a ``share.RequestShare`` in its ASGI scope: the ``generate_request`` hook
(``generate.py``) runs the prefills the method needs (``prefills.py``) and remembers the agent's
output tokens. An annotated ``/v1/chat/completions`` goes to SGLang's own chat serving
(``chat.py``, ``chat_serving.py``).
"""

from __future__ import annotations

import json
import logging
from typing import Callable

from cachetools import FIFOCache

from sglang.srt.entrypoints.http_server import get_global_state

from sglang_kvshare.config import KVShareArgs
from sglang_kvshare.integration.server.annotate import AnnotationMixin, OutputTokens
from sglang_kvshare.integration.server.asgi import read_body, replay, send_json, with_json_added, with_length
from sglang_kvshare.integration.server.auto import AutoMixin
from sglang_kvshare.integration.server.chat import ChatMixin
from sglang_kvshare.integration.server.prefills import PrefillMixin
from sglang_kvshare.integration.server.share import RequestShare, in_scope
from sglang_kvshare.segments import AnnotationError
from sglang_kvshare.segments.wire import KEY, output_agent

logger = logging.getLogger(__name__)

CHAT_PATH = "/v1/chat/completions"
INFO_PATHS = ("/server_info", "/get_server_info")


class KVShareMiddleware(AnnotationMixin, PrefillMixin, ChatMixin, AutoMixin):
    def __init__(self, app, args: KVShareArgs, get_tokenizer_manager: Callable):
        self.app = app
        self.args = args
        self.get_tm = get_tokenizer_manager
        self.outputs = OutputTokens(capacity=16 * args.max_workflows)
        self.referenced: FIFOCache = FIFOCache(16 * args.max_workflows)
        self.rebuilds: FIFOCache = FIFOCache(args.max_workflows)  # workflow -> its queued LP rebuilds
        self.rebuild_tasks: set = set()  # strong references until done (asyncio keeps weak ones)
        self.init_auto()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "GET" and scope.get("path") in INFO_PATHS:
            return await self.app(scope, receive, with_json_added(send, "kvshare_auto_index", self.index.info))
        path = scope.get("path") if scope["type"] == "http" and scope["method"] == "POST" else None
        if path not in ("/generate", CHAT_PATH):
            return await self.app(scope, receive, send)
        body = await read_body(receive)
        try:
            payload = json.loads(body) if body else None
        except ValueError:
            payload = None
        if not isinstance(payload, dict):
            return await self.app(scope, replay(body, receive), send)
        try:
            if KEY in payload:
                if path == CHAT_PATH:
                    return await self.chat(scope, receive, send, payload)
                ann, wire, payload = self.rewrite(payload)
                share = RequestShare(self, ann, payload["input_ids"], wire)
                share.sources_missing = self.note_sources(
                    ann.workflow, any(output_agent(s.slot) for s in wire.spans if s.shared)
                )
            else:
                method = self.auto_method(scope["headers"])
                if (
                    method is not None
                    and path == CHAT_PATH
                    and await self.auto_chat(scope, receive, send, payload, method)
                ):
                    return
                found = self.auto_generate(scope["headers"], payload, method) if method and path != CHAT_PATH else None
                if found is None:
                    return await self.app(scope, replay(body, receive), send)
                share, payload = found
        except AnnotationError as e:
            return await send_json(send, 400, {"error": {"message": f"kvshare: {e}", "code": 400}})
        body = json.dumps(payload).encode()
        scope = in_scope(dict(scope, headers=with_length(scope["headers"], len(body))), share)
        await self.app(scope, replay(body, receive), send)


def install(app, args: KVShareArgs) -> None:
    """Add the middleware to SGLang's FastAPI ``app`` (before the server starts)."""
    app.add_middleware(KVShareMiddleware, args=args, get_tokenizer_manager=lambda: get_global_state().tokenizer_manager)
