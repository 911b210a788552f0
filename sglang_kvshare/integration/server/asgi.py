"""ASGI helpers of the middleware (HTTP process): reading and replaying a request body, rewriting
a response's body messages, splitting server-sent events, answering JSON."""

from __future__ import annotations

import json


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


def with_json_added(send, key: str, value):
    """An ASGI ``send`` that adds ``key: value()`` to a 200 JSON object answer (the start message
    waits for the body, whose length changes)."""
    held: dict = {"start": None, "body": b""}

    async def wrapped(message):
        if message["type"] == "http.response.start" and message["status"] == 200:
            held["start"] = message
            return
        if message["type"] != "http.response.body" or held["start"] is None:
            return await send(message)
        held["body"] += message.get("body", b"")
        if message.get("more_body", False):
            return
        body = held["body"]
        try:
            answer = json.loads(body)
        except ValueError:
            answer = None
        if isinstance(answer, dict):
            body = json.dumps({**answer, key: value()}).encode()
        await send(dict(held["start"], headers=with_length(held["start"].get("headers", []), len(body))))
        await send({"type": "http.response.body", "body": body})

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


def with_length(headers, length: int) -> list:
    """ASGI ``headers`` with ``content-length`` set to ``length``."""
    return [(k, v) for k, v in headers if k.lower() != b"content-length"] + [(b"content-length", str(length).encode())]


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
