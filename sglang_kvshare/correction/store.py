"""Anchor pools on disk (warm start, ours): one file holds every corrector's state.

Layout (``torch.save``, loadable with ``weights_only=True``): ``{"format": FORMAT, "version":
VERSION, "header": {...}, "correctors": {name: state_dict}}``. ``header`` identifies what the
anchors were computed with (the model's shape, the anchor rank and dtype); ``check_header``
compares it with the running server's before anything is loaded. Writes go to a temporary file
that replaces the old one only when complete, so a crash mid-save never leaves half a file.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, Mapping, Optional

import torch

from sglang_kvshare.lowrank import Dense, Factor, LowRank

FORMAT = "sglang_kvshare.anchor_pool"
VERSION = 1


class AnchorPoolFileError(ValueError):
    """The file is unreadable, not an anchor pool file, or from another model or configuration."""


def factor_state(f: Factor) -> Dict[str, torch.Tensor]:
    return {"A": f.A, "B": f.B} if isinstance(f, LowRank) else {"Z": f.Z}


def factor_from_state(d: Mapping[str, torch.Tensor]) -> Factor:
    return LowRank(d["A"], d["B"]) if "A" in d else Dense(d["Z"])


def anchor_state(a) -> Dict[str, Any]:
    """One ``pool.Anchor`` as plain values and tensors."""
    return {
        "base": [factor_state(a.base_k), factor_state(a.base_v)],
        "deltas": {t: [factor_state(dk), factor_state(dv)] for t, (dk, dv) in a.deltas.items()},
        "source_agent": a.source_agent,
        "key": list(a.key),
        "use_count": a.use_count,
    }


def anchor_from_state(d: Mapping[str, Any]):
    """The ``pool.Anchor`` of an ``anchor_state`` output."""
    from sglang_kvshare.correction.pool import Anchor

    return Anchor(
        base_k=factor_from_state(d["base"][0]),
        base_v=factor_from_state(d["base"][1]),
        deltas={t: (factor_from_state(dk), factor_from_state(dv)) for t, (dk, dv) in d["deltas"].items()},
        source_agent=d["source_agent"],
        key=tuple(d["key"]),
        use_count=int(d["use_count"]),
    )


def save(path: str, header: Mapping[str, Any], correctors: Mapping[str, Any]) -> None:
    """Write the state of ``correctors`` (name -> object with ``state_dict()``) atomically."""
    payload = {
        "format": FORMAT,
        "version": VERSION,
        "header": dict(header),
        "correctors": {name: c.state_dict() for name, c in correctors.items() if hasattr(c, "state_dict")},
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    try:
        torch.save(payload, tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def read(path: str) -> Dict[str, Any]:
    """The file's contents (tensors memory-mapped); AnchorPoolFileError on any defect."""
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001 - every way a file can be broken
        raise AnchorPoolFileError(f"{path}: not a readable anchor pool file ({type(e).__name__}: {e})") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise AnchorPoolFileError(
            f"{path}: not an anchor pool file (format {payload.get('format') if isinstance(payload, dict) else type(payload).__name__!r})"
        )
    if payload.get("version") != VERSION:
        raise AnchorPoolFileError(
            f"{path}: anchor pool file version {payload.get('version')}, this server reads {VERSION}"
        )
    return payload


def check_header(path: str, found: Mapping[str, Any], expected: Mapping[str, Any]) -> None:
    """Raise AnchorPoolFileError naming every key where the file and the server differ."""
    diffs = [f"{k}: file {found.get(k)!r}, server {v!r}" for k, v in expected.items() if found.get(k) != v]
    if diffs:
        raise AnchorPoolFileError(f"{path} was written for another model or configuration ({'; '.join(diffs)})")


def load(
    path: str, expected_header: Mapping[str, Any], correctors: Mapping[str, Any], create: Optional[Any] = None
) -> int:
    """Check the file against ``expected_header`` and load each stored corrector's state into
    ``correctors[name]`` (made with ``create(name)`` when missing). Returns the anchors loaded."""
    payload = read(path)
    check_header(path, payload["header"], expected_header)
    n = 0
    for name, state in payload["correctors"].items():
        c = correctors.get(name)
        if c is None and create is not None:
            c = create(name)
        if c is None or not hasattr(c, "load_state_dict"):
            continue
        try:
            n += c.load_state_dict(state)
        except (KeyError, TypeError, ValueError) as e:
            raise AnchorPoolFileError(f"{path}: corrector {name!r} state is malformed ({e})") from None
    return n
