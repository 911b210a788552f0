"""One workflow of the fidelity benchmark: its turns sent with their dense shadows
(``ShadowedSender``), each turn measured against its shadow (``analyse_turn``), the whole run
recorded (``run_one``)."""

from __future__ import annotations

import copy
import math
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Dict, List, Optional

from benchmarks.fidelity.options import TAU_METHODS, TOP_K, TOPOLOGY, Arm
from benchmarks.fidelity.records import SEGMENT_KEYS, Exchange, RunRecord, SegmentError, ShadowComparison, TurnRecord
from benchmarks.fidelity_metrics import (
    common_prefix,
    first_token_requested,
    first_token_top,
    kl_lumped,
    kl_topk_union,
    kv_error,
    leading_agreement,
    load_dump,
    output_ids,
    reuse_counts,
    safe_name,
)
from benchmarks.scoring import score_output
from sglang_kvshare.methods import method_variant
from sglang_kvshare.workflows import run_task


class ShadowedSender:
    """A ``send`` for ``run_task``: per turn, the dense shadow (optional), then the real request,
    both asking for first-token logprobs. Records each turn's replies in ``self.turns``."""

    def __init__(self, send, arm: Arm, shadow_workflow: str, shadow: bool):
        self.send = send
        self.arm = arm
        self.shadow_workflow = shadow_workflow
        self.shadow = shadow
        self.turns: List[Exchange] = []

    def __call__(self, payload: Dict[str, Any]) -> Dict[str, Any]:
        logprob = {"return_logprob": True, "top_logprobs_num": TOP_K, "logprob_start_len": -1}
        shadow_reply, shadow_latency, dense_ids = None, None, []
        if self.shadow:
            sp = copy.deepcopy(payload)
            sp["kvshare"]["workflow"] = self.shadow_workflow
            sp["kvshare"]["method"] = "nonshared"
            sp["kvshare"].pop("tau", None)
            sp.update(logprob)
            t0 = time.perf_counter()
            shadow_reply = self.send(sp)
            shadow_latency = time.perf_counter() - t0
            dense_ids = sorted(first_token_top(shadow_reply))
        real = copy.deepcopy(payload)
        if self.arm.tau is not None and method_variant(self.arm.method)[0] in TAU_METHODS:
            real["kvshare"]["tau"] = self.arm.tau
        if self.arm.recompute_ratio is not None:
            real["kvshare"]["recompute_ratio"] = self.arm.recompute_ratio
        real.update(logprob)
        if dense_ids:
            real["token_ids_logprob"] = dense_ids
        t0 = time.perf_counter()
        reply = self.send(real)
        self.turns.append(Exchange(payload, reply, time.perf_counter() - t0, shadow_reply, shadow_latency))
        return reply


def _wait_file(path: Path, timeout: float = 15.0) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if path.exists():
            return True
        time.sleep(0.1)
    return path.exists()


def _segment_shape(kvshare: Dict[str, Any]) -> List[int]:
    return [int(s.get("tokens", 0)) for s in kvshare.get("segments") or []]


def _kvshare(reply: Dict[str, Any]) -> Dict[str, Any]:
    return (reply.get("meta_info") or {}).get("kvshare") or {}


def segment_errors(kv: Dict[str, Any], agent: str, workflow: str, shadow_workflow: str, dump_root: Path):
    """The :class:`SegmentError` of every shared segment of a turn (reused ones and the rest)."""
    errs = []
    for seg in kv.get("segments") or []:
        if not seg.get("shared"):
            continue
        slot = seg["slot"]
        fa = dump_root / safe_name(workflow) / safe_name(agent) / f"{safe_name(slot)}.pt"
        fd = dump_root / safe_name(shadow_workflow) / safe_name(agent) / f"{safe_name(slot)}.pt"
        if not (_wait_file(fa) and _wait_file(fd)):
            errs.append(SegmentError(slot, seg.get("mode"), seg.get("tokens"), missing=True))
            continue
        e = kv_error(load_dump(fa), load_dump(fd))
        errs.append(SegmentError(slot, seg.get("mode"), seg.get("tokens"), mismatch=e is None, error=e))
    return tuple(errs)


def compare_shadow(turn: Exchange, kv: Dict[str, Any], a_ids: List[int]) -> ShadowComparison:
    """The turn's first-token distribution and greedy output against its dense shadow's (no KV
    error: ``analyse_turn`` adds it)."""
    shadow, real = turn.shadow, turn.real
    skv = _kvshare(shadow)
    p, q_req, q_top = first_token_top(shadow), first_token_requested(real), first_token_top(real)
    kl, kl_method = kl_lumped(p, q_req), "token_ids_logprob"
    if kl is None:
        kl, kl_method = kl_topk_union(p, q_top), "topk_union_bound"
    top1 = rest = None
    if p and q_top:
        top1 = max(p, key=p.get) == max(q_top, key=q_top.get)
        rest = max(1.0 - sum(math.exp(v) for v in p.values()), 0.0)
    d_ids = output_ids(shadow)
    return ShadowComparison(
        shadow_latency_s=round(turn.shadow_latency_s, 3),
        shadow_text=shadow.get("text", ""),
        prompt_match=skv.get("prompt_tokens") == kv.get("prompt_tokens") and _segment_shape(skv) == _segment_shape(kv),
        kl_method=kl_method,
        kl=kl,
        top1_agree=top1,
        dense_rest_mass=rest,
        exact_match=real.get("text", "") == shadow.get("text", ""),
        lead_agree=leading_agreement(a_ids, d_ids),
        common_prefix=common_prefix(a_ids, d_ids),
    )


def analyse_turn(
    position: int, turn: Exchange, workflow: str, shadow_workflow: str, dump_root: Optional[Path]
) -> TurnRecord:
    """The measurements of one agent turn (and its shadow, when there is one)."""
    real = turn.real
    kv = _kvshare(real)
    agent = turn.payload["kvshare"]["agent"]
    reused, shared = reuse_counts(kv)
    ids = output_ids(real)
    comparison = None
    if turn.shadow is not None:
        comparison = compare_shadow(turn, kv, ids)
        if dump_root is not None:
            errs = segment_errors(kv, agent, workflow, shadow_workflow, dump_root)
            comparison = replace(comparison, seg_errors=errs)
    return TurnRecord(
        position=position,
        agent=agent,
        payload_kvshare=turn.payload["kvshare"],  # what was sent (segments' text)
        text=real.get("text", ""),
        output_ids=tuple(ids),
        latency_s=round(turn.latency_s, 3),
        prompt_tokens=kv.get("prompt_tokens"),
        computed_tokens=kv.get("computed_tokens"),
        reference_tokens=kv.get("reference_tokens", 0),
        reused_tokens=kv.get("reused_tokens"),
        injected_tokens=kv.get("injected_tokens"),
        corrections_accepted=kv.get("corrections_accepted", 0),
        corrections_rejected=kv.get("corrections_rejected", 0),
        anchor_bytes=kv.get("anchor_bytes"),
        rebuild_tokens=kv.get("rebuild_tokens", 0),
        kv_bytes_per_token=kv.get("kv_bytes_per_token"),
        lr_bytes_per_token_per_agent=kv.get("lr_bytes_per_token_per_agent"),
        shared_tokens=shared,
        shared_reused=reused,
        segments=tuple(
            {k: s.get(k) for k in SEGMENT_KEYS if k in s} for s in kv.get("segments") or [] if s.get("shared")
        ),
        shadow=comparison,
    )


def run_one(
    send,
    task,
    roles,
    arm: Arm,
    tag: str,
    max_new_tokens: int,
    shadow: bool,
    dump_root: Optional[Path],
    keep_dumps: bool,
) -> RunRecord:
    """``task`` under ``arm`` as one workflow (its turns shadowed when ``shadow``), measured."""
    workflow = f"fid:{tag}:{arm.label}:{task.id}"
    shadow_workflow = f"fidshadow:{tag}:{arm.label}:{task.id}"
    sender = ShadowedSender(send, arm, shadow_workflow, shadow)
    t0 = time.perf_counter()
    record = run_task(
        task, roles, TOPOLOGY, arm.method, sender, max_new_tokens, workflow_id=workflow, score_fn=score_output
    )
    wall = time.perf_counter() - t0
    turns = [analyse_turn(i, t, workflow, shadow_workflow, dump_root) for i, t in enumerate(sender.turns)]
    if dump_root is not None and not keep_dumps:
        for wf in (workflow, shadow_workflow):
            shutil.rmtree(dump_root / safe_name(wf), ignore_errors=True)
    return RunRecord(
        task_id=task.id,
        method=arm.method,
        tau=arm.tau,
        recompute_ratio=arm.recompute_ratio,
        label=arm.label,
        workflow=workflow,
        shadowed=shadow,
        reference=task.reference,
        final_output=record.final_output,
        correct=bool(record.score.correct),
        predicted=record.score.predicted,
        wall_s=round(wall, 2),
        turns=tuple(turns),
    )
