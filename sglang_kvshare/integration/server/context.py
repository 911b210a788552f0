"""What the HTTP process's hooks share (``plugin.py`` builds one and registers them with it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sglang_kvshare.integration.server.metrics import Metrics


@dataclass
class ServerContext:
    """The ``kvshare_*`` metrics, and the annotated chat requests SGLang's chat serving is
    converting now (id of SGLang's request object -> ``chat.ChatShare``; ``chat_serving.py``)."""

    metrics: Metrics = field(default_factory=Metrics)
    converting: dict[int, Any] = field(default_factory=dict)
