"""Response side of annotated requests (main process): recording the agent's output from a JSON
answer or from server-sent events (``meta_info.kvshare`` as one object), and the ASGI helpers."""

from __future__ import annotations

import json

from sglang_kvshare.segments.spec import KVShareAnnotation


class ResponseMixin:
    """Needs ``get_tm`` and ``_remember``."""

    def _recording_send(self, send, ann: KVShareAnnotation):
        chunks: list[bytes] = []
        state = {"status": 200}
        tok = self.get_tm().tokenizer

        async def wrapped(message):
            if message["type"] == "http.response.start":
                state["status"] = message["status"]
            elif message["type"] == "http.response.body" and state["status"] == 200:
                chunks.append(message.get("body", b""))
                if not message.get("more_body", False):
                    self._remember(ann, b"".join(chunks), tok)
            await send(message)

        return wrapped

    def _streaming_send(self, send, ann: KVShareAnnotation):
        """Pass server-sent events through with ``meta_info.kvshare`` as one object, and
        remember the agent's output tokens from the last event."""
        state = {"status": 200, "pending": b"", "last": None}
        tok = self.get_tm().tokenizer

        def fix(event: bytes) -> bytes:
            if not event.startswith(b"data: ") or event.strip() == b"data: [DONE]":
                return event
            try:
                obj = json.loads(event[len(b"data: ") :])
            except ValueError:
                return event
            meta = obj.get("meta_info") if isinstance(obj, dict) else None
            if isinstance(meta, dict) and isinstance(meta.get("kvshare"), list):
                meta["kvshare"] = meta["kvshare"][-1] if meta["kvshare"] else None
            state["last"] = obj
            return b"data: " + json.dumps(obj).encode()

        async def wrapped(message):
            if message["type"] == "http.response.start":
                state["status"] = message["status"]
                message = dict(message, headers=[(k, v) for k, v in message.get("headers", [])
                                                 if k.lower() != b"content-length"])
            elif message["type"] == "http.response.body" and state["status"] == 200:
                events, more = split_events(state, message)
                body = b"".join(fix(e) + b"\n\n" for e in events)
                if not more:
                    if state["last"] is not None:
                        self._remember(ann, state["last"], tok)
                message = dict(message, body=body)
            await send(message)

        return wrapped


def split_events(state: dict, message: dict) -> tuple[list[bytes], bool]:
    """The complete server-sent events of a response body ``message`` (non-empty, without their
    blank-line separator), a partial last one kept in ``state["pending"]`` until the next body
    message; and whether more body follows."""
    data = state["pending"] + message.get("body", b"")
    more = message.get("more_body", False)
    events = data.split(b"\n\n")
    state["pending"] = events.pop() if more else b""
    return [e for e in events if e], more


async def read_body(receive) -> bytes:
    parts = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        parts.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(parts)


def replay(body: bytes, receive):
    """A receive channel that yields ``body`` once, then the client's own messages."""
    sent = False

    async def replayed():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


async def send_json(send, status: int, obj: dict) -> None:
    data = json.dumps(obj).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": data})
