"""Pure metric helpers of ``benchmarks.fidelity`` (no server, no SGLang import).

Everything here works on plain ``/generate`` JSON replies and on the ``--kvshare-dump-dir`` files
(``{"k", "v": [layers, n, kv_heads, head_dim] float32, "start", "token_ids", "meta"}``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from sglang_kvshare.segments.sources import common_prefix

REUSED_MODES = ("injected", "corrected", "recomputed")


def safe_name(name: str) -> str:
    """Directory/file name of a workflow, agent or slot in the dump dir (mirrors
    ``sglang_kvshare.integration.cache.radix._safe``, which we do not import: it pulls in SGLang)."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


# ----------------------------------------------------------------------------- logprobs


def first_token_top(reply: Dict[str, Any]) -> Dict[int, float]:
    """``{token_id: logprob}`` of the first generated token's top-k (``output_top_logprobs[0]``,
    entries ``[logprob, token_id, text|None]``); {} when absent."""
    meta = reply.get("meta_info") or {}
    rows = meta.get("output_top_logprobs") or []
    if not rows or not rows[0]:
        return {}
    return {int(e[1]): float(e[0]) for e in rows[0] if e is not None and e[0] is not None}


def first_token_requested(reply: Dict[str, Any]) -> Dict[int, float]:
    """``{token_id: logprob}`` of the first generated token for the ids asked for with
    ``token_ids_logprob`` (``output_token_ids_logprobs[0]``); {} when absent."""
    meta = reply.get("meta_info") or {}
    rows = meta.get("output_token_ids_logprobs") or []
    if not rows or not rows[0]:
        return {}
    return {int(e[1]): float(e[0]) for e in rows[0] if e is not None and e[0] is not None}


def output_ids(reply: Dict[str, Any]) -> List[int]:
    """Generated token ids: the reply's ``output_ids``, else from ``output_token_logprobs``."""
    if reply.get("output_ids") is not None:
        return [int(t) for t in reply["output_ids"]]
    meta = reply.get("meta_info") or {}
    return [int(e[1]) for e in meta.get("output_token_logprobs") or []]


def kl_lumped(p: Dict[int, float], q: Dict[int, float], floor: float = 1e-12) -> Optional[float]:
    """KL(P || Q) in nats over the support of P's top-k plus one lumped "rest" outcome.

    ``p``: the dense distribution's top-k logprobs; ``q``: the approximate distribution's logprobs
    on exactly those ids. The rest mass is ``1 - sum`` of each (clamped at ``floor``). This is the
    KL of the coarse-grained distributions, a lower bound of the full-vocabulary KL (data
    processing inequality); with k = 20 on a 49K vocabulary the lumped mass of P is usually small.
    None when ``q`` lacks an id of ``p``.
    """
    if not p or any(t not in q for t in p):
        return None
    kl = 0.0
    p_sum = q_sum = 0.0
    for t, lp in p.items():
        pp = math.exp(lp)
        p_sum += pp
        q_sum += math.exp(q[t])
        kl += pp * (lp - q[t])
    p_rest = max(1.0 - p_sum, 0.0)
    q_rest = max(1.0 - q_sum, floor)
    if p_rest > floor:
        kl += p_rest * (math.log(p_rest) - math.log(q_rest))
    return max(kl, 0.0)


def kl_topk_union(p: Dict[int, float], q: Dict[int, float]) -> Optional[float]:
    """Fallback KL(P || Q) when Q is only known on its own top-k: ids of P's top-k missing from
    Q's get Q's smallest listed logprob (an upper bound of their true value), then ``kl_lumped``.
    Used only when the server ignored ``token_ids_logprob``."""
    if not p or not q:
        return None
    low = min(q.values())
    return kl_lumped(p, {t: q.get(t, low) for t in p})


def leading_agreement(approx: Sequence[int], dense: Sequence[int]) -> float:
    """Identical leading tokens / the longer output's length (1.0 when both are empty)."""
    longest = max(len(approx), len(dense))
    return 1.0 if longest == 0 else common_prefix(approx, dense) / longest


# ----------------------------------------------------------------------------- kv error


def load_dump(path: Path):
    import torch

    return torch.load(path, map_location="cpu", weights_only=False)


@dataclass(frozen=True)
class KvError:
    """Frobenius error of one segment's cache: ``rel = ||C_hat - C||_F / ||C||_F`` with C the K and V
    of all layers together, ``k_rel`` / ``v_rel`` for K and V alone, and the sums of squares behind
    them (``diff2`` = ``||C_hat - C||^2``, ``ref2`` = ``||C||^2``) for pooling."""

    rel: float
    k_rel: float
    v_rel: float
    diff2: float
    ref2: float
    k_diff2: float
    k_ref2: float
    v_diff2: float
    v_ref2: float


def kv_error(approx: Dict[str, Any], dense: Dict[str, Any]) -> Optional[KvError]:
    """The :class:`KvError` of ``approx`` against ``dense`` (two dumps of one segment); None when
    they are not the same tokens at the same position."""
    import torch

    if approx["start"] != dense["start"] or list(approx["token_ids"]) != list(dense["token_ids"]):
        return None
    sums: Dict[str, float] = {}
    for name in ("k", "v"):
        a = approx[name].double()
        d = dense[name].double()
        if a.shape != d.shape:
            return None
        sums[f"{name}_diff2"] = float(torch.sum((a - d) ** 2))
        sums[f"{name}_ref2"] = float(torch.sum(d**2))
    sums["diff2"] = sums["k_diff2"] + sums["v_diff2"]
    sums["ref2"] = sums["k_ref2"] + sums["v_ref2"]
    rel = {}
    for prefix in ("", "k_", "v_"):
        ref = sums[f"{prefix}ref2"]
        rel[f"{prefix}rel"] = math.sqrt(sums[f"{prefix}diff2"] / ref) if ref > 0 else float("nan")
    return KvError(**rel, **sums)


def pooled(errors: Iterable[KvError], prefix: str = "") -> Optional[float]:
    """sqrt(sum ||C_hat - C||^2 / sum ||C||^2) over segments; ``prefix`` "k_" or "v_": K or V alone."""
    errors = list(errors)
    ref = sum(getattr(e, f"{prefix}ref2") for e in errors)
    if not errors or ref <= 0:
        return None
    return math.sqrt(sum(getattr(e, f"{prefix}diff2") for e in errors) / ref)


# ----------------------------------------------------------------------------- aggregation


def mean(xs: Iterable[Optional[float]]) -> Optional[float]:
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return sum(xs) / len(xs) if xs else None


def recomputed_reuse(seg: Dict[str, Any]) -> float:
    """Reused tokens of a segment under selective recomputation: its source-covered tokens times
    the fraction of their token-layers that were reused; 0 for any other segment."""
    if seg.get("mode") != "recomputed" or not seg.get("token_layers"):
        return 0.0
    return seg["source_tokens"] * (1.0 - seg["recomputed_token_layers"] / seg["token_layers"])


def reuse_counts(kvshare: Dict[str, Any]) -> Tuple[float, int]:
    """(reused shared tokens, shared tokens) of one request: shared tokens served by injected or
    corrected segments (their ``injected_tokens``), over all shared segments' tokens. A segment
    under selective recomputation counts its source-covered tokens times the fraction of their
    token-layers that were reused (``1 - recomputed_token_layers / token_layers``)."""
    reused = 0.0
    total = 0
    for seg in kvshare.get("segments") or []:
        if not seg.get("shared"):
            continue
        total += int(seg.get("tokens", 0))
        if seg.get("mode") == "recomputed":
            reused += recomputed_reuse(seg)
        elif seg.get("mode") in REUSED_MODES:
            reused += int(seg.get("injected_tokens", seg.get("tokens", 0)))
    return reused, total
