"""The HTTP process's layer: an ASGI middleware on SGLang's own FastAPI app for annotated requests.

For a ``POST /generate`` whose JSON body has a ``kvshare`` object, it validates and tokenises the
annotation (``annotate.py``; HTTP 400 naming the defect), adds the prefills the method needs
(``prefills.py``), forwards the request to SGLang as ``input_ids`` and reads the response to
remember the agent's output tokens (``responses.py``). An annotated ``/v1/chat/completions`` goes
to SGLang's own chat serving (``chat.py``, ``chat_serving.py``).
"""

from __future__ import annotations

import json
import logging
from typing import Callable

from cachetools import FIFOCache

from sglang.srt.entrypoints.http_server import get_global_state

from sglang_kvshare.config import KVShareArgs
from sglang_kvshare.integration.server.annotate import AnnotationMixin, OutputTokens, spec_of, with_spec
from sglang_kvshare.integration.server.asgi import read_body, replay, send_json
from sglang_kvshare.integration.server.chat import ChatMixin
from sglang_kvshare.integration.server.prefills import PrefillMixin
from sglang_kvshare.integration.server.responses import ResponseMixin
from sglang_kvshare.methods import get_method
from sglang_kvshare.segments import AnnotationError
from sglang_kvshare.segments.spec import KVShareAnnotation
from sglang_kvshare.segments.wire import KEY

logger = logging.getLogger(__name__)

CHAT_PATH = "/v1/chat/completions"


class KVShareMiddleware(AnnotationMixin, PrefillMixin, ResponseMixin, ChatMixin):
    def __init__(self, app, args: KVShareArgs, get_tokenizer_manager: Callable):
        self.app = app
        self.args = args
        self.get_tm = get_tokenizer_manager
        self.outputs = OutputTokens(capacity=16 * args.max_workflows)
        self.referenced: FIFOCache = FIFOCache(16 * args.max_workflows)
        self.rebuilds: FIFOCache = FIFOCache(args.max_workflows)  # workflow -> its queued LP rebuilds
        self.rebuild_tasks: set = set()  # strong references until done (asyncio keeps weak ones)

    async def __call__(self, scope, receive, send):
        path = scope.get("path") if scope["type"] == "http" and scope["method"] == "POST" else None
        if path not in ("/generate", CHAT_PATH):
            return await self.app(scope, receive, send)
        body = await read_body(receive)
        try:
            payload = json.loads(body) if body else None
        except ValueError:
            payload = None
        if not isinstance(payload, dict) or KEY not in payload:
            return await self.app(scope, replay(body, receive), send)
        try:
            if path == CHAT_PATH:
                return await self.chat(scope, receive, send, payload)
            ann, payload = self.rewrite(payload)
        except AnnotationError as e:
            return await send_json(send, 400, {"error": {"message": f"kvshare: {e}", "code": 400}})
        await self.forward_generate(scope, receive, send, ann, payload)

    async def forward_generate(self, scope, receive, send, ann: KVShareAnnotation, payload: dict) -> None:
        """Send a rewritten /generate body to SGLang, recording the agent's output tokens."""
        method = get_method(ann.method)
        ids = payload["input_ids"]
        wire = await self.prepare(ann, spec_of(payload["sampling_params"]), ids)
        payload["sampling_params"] = with_spec(payload["sampling_params"], wire)
        new_body = json.dumps(payload).encode()
        headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(new_body)).encode()))
        scope = dict(scope, headers=headers)
        on_done = None
        if method.lr_sharing == "rebase_lp" and payload.get("lora_path") is not None:
            on_done = lambda out: self.queue_rebuild(ann, ids, out)  # noqa: E731
        if payload.get("stream"):
            return await self.app(scope, replay(new_body, receive), self._streaming_send(send, ann, on_done))
        return await self.app(scope, replay(new_body, receive), self._recording_send(send, ann, on_done))


def install(app, args: KVShareArgs) -> None:
    """Add the middleware to SGLang's FastAPI ``app`` (before the server starts)."""
    app.add_middleware(
        KVShareMiddleware, args=args, get_tokenizer_manager=lambda: get_global_state().tokenizer_manager
    )
