"""Names on the wire between a client, the HTTP process and the scheduler, defined once.

- ``KEY`` (``"kvshare"``): the annotation in a request body, the segment spec in
  ``sampling_params.custom_params``, the per-request record in ``meta_info`` and the sharing
  state in ``/server_info``'s internal state.
- ``OUTPUT_SLOT_PREFIX`` (``"out:"``): agent ``X``'s generated output is the shared slot
  ``out:X`` for later agents (:func:`output_slot`, :func:`output_agent`).
- :func:`one_record`: SGLang hands per-request custom info to the HTTP process as a list (one
  entry per emitted chunk); ``meta_info.kvshare`` is its last entry, one object.
"""

from __future__ import annotations

from typing import Any, Optional

KEY = "kvshare"
OUTPUT_SLOT_PREFIX = "out:"


def output_slot(agent: str) -> str:
    """The shared slot that stands for ``agent``'s generated output."""
    return OUTPUT_SLOT_PREFIX + agent


def output_agent(slot: Optional[str]) -> Optional[str]:
    """The agent whose output slot ``slot`` is (None: not an output slot, or no slot)."""
    return slot[len(OUTPUT_SLOT_PREFIX) :] if slot and slot.startswith(OUTPUT_SLOT_PREFIX) else None


def one_record(value: Any) -> Any:
    """``meta_info.kvshare`` as one object: the last entry of a list, else the value itself."""
    if isinstance(value, list):
        return value[-1] if value else None
    return value
