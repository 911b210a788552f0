"""Response side of annotated requests (HTTP process): recording the agent's output from a JSON
answer or from server-sent events (``meta_info.kvshare`` as one object)."""

from __future__ import annotations

import json

from sglang_kvshare.integration.server.asgi import ok_body_send, split_events
from sglang_kvshare.segments.spec import KVShareAnnotation
from sglang_kvshare.segments.wire import KEY, one_record


class ResponseMixin:
    """Needs ``remember``."""

    def _recording_send(self, send, ann: KVShareAnnotation, on_done=None):
        """``on_done(answer)`` (optional) gets the parsed answer of a 200 response."""
        chunks: list[bytes] = []

        def record(message):
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                try:
                    out = json.loads(b"".join(chunks))
                except ValueError:
                    return message
                self.remember(ann, out)
                if on_done is not None:
                    on_done(out)
            return message

        return ok_body_send(send, record)

    def _streaming_send(self, send, ann: KVShareAnnotation, on_done=None):
        """Pass server-sent events through with ``meta_info.kvshare`` as one object, and
        remember the agent's output tokens from the last event (also given to ``on_done``)."""
        state = {"pending": b"", "last": None}

        def fix(event: bytes) -> bytes:
            if not event.startswith(b"data: ") or event.strip() == b"data: [DONE]":
                return event
            try:
                obj = json.loads(event[len(b"data: ") :])
            except ValueError:
                return event
            meta = obj.get("meta_info") if isinstance(obj, dict) else None
            if isinstance(meta, dict) and KEY in meta:
                meta[KEY] = one_record(meta[KEY])
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
                    self.remember(ann, state["last"])
                    if on_done is not None:
                        on_done(state["last"])
            return dict(message, body=body)

        return ok_body_send(send, rewrite, on_start=drop_length)
