"""The ``send`` of a workflow over HTTP: POST /generate, errors carry the server's message."""

from __future__ import annotations

from typing import Any, Callable, Dict

import requests

from sglang_kvshare.routing import routing_headers

SendFn = Callable[[Dict[str, Any]], Dict[str, Any]]


class ServerError(RuntimeError):
    """The server answered a /generate request with a non-200 status."""


def _error_message(response: requests.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text.strip()[:2000] or "<empty body>"
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        for key in ("message", "detail", "error"):
            if key in body:
                return str(body[key])
    return str(body)[:2000]


def http_sender(base_url: str, timeout: float = 600.0) -> SendFn:
    """A ``send`` that POSTs the payload as JSON to ``<base_url>/generate`` and returns the JSON
    reply; a non-200 status raises ``ServerError`` carrying the server's error message. An
    annotated payload carries its workflow in the router's routing-key header, so behind
    ``launch_router`` all agents of a workflow reach the same worker."""
    url = base_url.rstrip("/") + "/generate"
    session = requests.Session()

    def send(payload: Dict[str, Any]) -> Dict[str, Any]:
        response = session.post(url, json=payload, headers=routing_headers(payload), timeout=timeout)
        if response.status_code != 200:
            raise ServerError(f"POST {url} -> HTTP {response.status_code}: {_error_message(response)}")
        return response.json()

    return send
