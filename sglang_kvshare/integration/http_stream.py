"""Response side of annotated requests (main process): recording the agent's output from a JSON
answer or from server-sent events (``meta_info.kvshare`` as one object), and the ASGI helpers."""

from __future__ import annotations

import json

from sglang_kvshare.segments.spec import KVShareAnnotation


class ResponseMixin:
    """Needs ``get_tm`` and ``_remember``."""

    def _recording_send(self, send, ann: KVShareAnnotation, on_done=None):
        """``on_done(answer)`` (optional) gets the parsed answer of a 200 response."""
        chunks: list[bytes] = []
        tok = self.get_tm().tokenizer

        def record(message):
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                try:
                    out = json.loads(b"".join(chunks))
                except ValueError:
                    return message
                self._remember(ann, out, tok)
                if on_done is not None:
                    on_done(out)
            return message

        return ok_body_send(send, record)

    def _streaming_send(self, send, ann: KVShareAnnotation, on_done=None):
        """Pass server-sent events through with ``meta_info.kvshare`` as one object, and
        remember the agent's output tokens from the last event (also given to ``on_done``)."""
        state = {"pending": b"", "last": None}
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

        def drop_length(message):
            return dict(message, headers=[(k, v) for k, v in message.get("headers", [])
                                          if k.lower() != b"content-length"])

        def rewrite(message):
            events, more = split_events(state, message)
            body = b"".join(fix(e) + b"\n\n" for e in events)
            if not more:
                if state["last"] is not None:
                    self._remember(ann, state["last"], tok)
                    if on_done is not None:
                        on_done(state["last"])
            return dict(message, body=body)

        return ok_body_send(send, rewrite, on_start=drop_length)


def ok_body_send(send, on_body, on_start=None):
    """An ASGI ``send`` that hands each body message of a 200 response to ``on_body`` (it
    returns the message to send on) and passes every other message through (the start message
    through ``on_start`` when given)."""
    status = [200]

    async def wrapped(message):
        if message["type"] == "http.response.start":
            status[0] = message["status"]
            if on_start is not None:
                message = on_start(message)
        elif message["type"] == "http.response.body" and status[0] == 200:
            message = on_body(message)
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
