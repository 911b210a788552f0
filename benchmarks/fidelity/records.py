"""Typed records of the fidelity benchmark: one turn's requests as sent and answered, its
measurements, one workflow run. Each is written to the results JSON by ``to_json`` with the keys
and nesting of earlier runs, and read back (``--from-json``, ``benchmarks.coverage``) by
``from_json``, which also takes the files of earlier versions (keys they lack get defaults)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Dict, Mapping, Optional, Tuple, Union

from benchmarks.fidelity_metrics import KvError

# the keys of a shared segment's server report (``meta_info.kvshare.segments``) that a turn keeps
SEGMENT_KEYS = (
    "slot",
    "tokens",
    "mode",
    "injected_tokens",
    "source_agent",
    "gate",
    "entropy",
    "anchors",
    "corrected_rows",
    "recompute_ratio",
    "source_tokens",
    "token_layers",
    "recomputed_token_layers",
    "layer_groups",
    "reason",
    "kept_as",
    "leaf_rank",
    "leaf_bytes",
)


@dataclass(frozen=True)
class Exchange:
    """One turn as ``ShadowedSender`` sent it: the workflow's payload, the real request's reply
    and, when shadowed, the dense shadow's reply (``/generate`` JSON), each with its latency."""

    payload: Dict[str, Any]
    real: Dict[str, Any]
    latency_s: float
    shadow: Optional[Dict[str, Any]] = None
    shadow_latency_s: Optional[float] = None


@dataclass(frozen=True)
class SegmentError:
    """The cache error of one shared segment against the shadow's: ``error`` None when a dump is
    ``missing`` or the two dumps are not the same tokens (``mismatch``)."""

    slot: str
    mode: Optional[str]
    tokens: Optional[int]
    missing: bool = False
    mismatch: bool = False
    error: Optional[KvError] = None

    def to_json(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {"slot": self.slot, "mode": self.mode, "tokens": self.tokens}
        if self.missing:
            out["missing"] = True
        if self.mismatch:
            out["mismatch"] = True
        if self.error is not None:
            out.update(asdict(self.error))
        return out

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "SegmentError":
        error = KvError(**{f.name: d[f.name] for f in fields(KvError)}) if "rel" in d else None
        return cls(d["slot"], d.get("mode"), d.get("tokens"), "missing" in d, "mismatch" in d, error)


# written only when set (a turn without them lacks the key)
_OPTIONAL_SHADOW_KEYS = ("top1_agree", "dense_rest_mass", "seg_errors")


@dataclass(frozen=True)
class ShadowComparison:
    """A turn against its dense shadow. ``kl``: first-token KL(dense || approx) by ``kl_method``;
    ``top1_agree`` / ``dense_rest_mass`` None when a side had no top-k; ``seg_errors`` None when
    no dumps were read (no dump dir)."""

    shadow_latency_s: float
    shadow_text: str
    prompt_match: bool
    kl_method: Optional[str]
    kl: Optional[float]
    top1_agree: Optional[bool]
    dense_rest_mass: Optional[float]
    exact_match: bool
    lead_agree: float
    common_prefix: int
    seg_errors: Optional[Tuple[SegmentError, ...]] = None

    def to_json(self) -> Dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        for key in _OPTIONAL_SHADOW_KEYS:
            if out[key] is None:
                del out[key]
        if self.seg_errors is not None:
            out["seg_errors"] = [e.to_json() for e in self.seg_errors]
        return out

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "ShadowComparison":
        errs = d.get("seg_errors")
        return cls(
            d.get("shadow_latency_s", 0.0),
            d.get("shadow_text", ""),
            d.get("prompt_match", True),
            d.get("kl_method"),
            d["kl"],
            d.get("top1_agree"),
            d.get("dense_rest_mass"),
            d["exact_match"],
            d["lead_agree"],
            d.get("common_prefix", 0),
            None if errs is None else tuple(SegmentError.from_json(e) for e in errs),
        )


@dataclass(frozen=True)
class TurnRecord:
    """One agent turn: what was sent (``payload_kvshare``, the segments' text), the reply and the
    server's ``meta_info.kvshare`` counts, the shared segments' reports (``SEGMENT_KEYS`` of each,
    as the server sent them) and, when shadowed, the comparison with the dense shadow."""

    position: int
    agent: str
    payload_kvshare: Dict[str, Any]
    text: str
    output_ids: Tuple[int, ...]
    latency_s: float
    prompt_tokens: Optional[int]
    computed_tokens: Optional[int]
    reference_tokens: int
    reused_tokens: Optional[int]
    injected_tokens: Optional[int]
    corrections_accepted: int
    corrections_rejected: int
    anchor_bytes: Optional[int]
    rebuild_tokens: int
    kv_bytes_per_token: Optional[int]
    lr_bytes_per_token_per_agent: Optional[int]
    shared_tokens: int
    shared_reused: float
    segments: Tuple[Dict[str, Any], ...]
    shadow: Optional[ShadowComparison] = None

    def to_json(self) -> Dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "shadow"}
        out["output_ids"] = list(self.output_ids)
        out["segments"] = list(self.segments)
        if self.shadow is not None:
            out.update(self.shadow.to_json())
        return out

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "TurnRecord":
        defaults = {"reference_tokens": 0, "corrections_accepted": 0, "corrections_rejected": 0, "rebuild_tokens": 0}
        kw = {f.name: d.get(f.name, defaults.get(f.name)) for f in fields(cls) if f.name != "shadow"}
        kw["payload_kvshare"] = d.get("payload_kvshare") or {}
        kw["output_ids"] = tuple(d.get("output_ids") or ())
        kw["segments"] = tuple(d.get("segments") or ())
        return cls(**kw, shadow=ShadowComparison.from_json(d) if "kl" in d else None)


@dataclass(frozen=True)
class RunRecord:
    """One workflow (one task under one method label) and its turns."""

    task_id: str
    method: str
    tau: Optional[float]
    recompute_ratio: Optional[float]
    label: str
    workflow: str
    shadowed: bool
    reference: str
    final_output: str
    correct: bool
    predicted: Optional[str]
    wall_s: float
    turns: Tuple[TurnRecord, ...]

    @property
    def shadow_workflow(self) -> str:
        """The workflow id of the turns' dense shadows."""
        return self.workflow.replace("fid:", "fidshadow:", 1)

    def to_json(self) -> Dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["turns"] = [t.to_json() for t in self.turns]
        return out


@dataclass(frozen=True)
class FailedRun:
    """A workflow that raised: the error, recorded, and the run went on."""

    task_id: str
    method: str
    tau: Optional[float]
    label: str
    error: str

    def to_json(self) -> Dict[str, Any]:
        return asdict(self)


Run = Union[RunRecord, FailedRun]


def run_from_json(d: Mapping[str, Any]) -> Run:
    """A run record of a results JSON (``*_runs``) as written by ``to_json``."""
    if "error" in d:
        return FailedRun(d["task_id"], d["method"], d.get("tau"), d["label"], d["error"])
    turns = tuple(TurnRecord.from_json(t) for t in d["turns"])
    kw = {f.name: d.get(f.name) for f in fields(RunRecord) if f.name != "turns"}
    return RunRecord(**{**kw, "turns": turns})
