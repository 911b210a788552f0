"""The coverage benchmark's measurements: every reused segment of a later agent paired with its
exact (shadow) cache from the dumps, the DroidSpeak profile built from such pairs, the attention
importance of prompt tokens (a ``transformers`` forward), and each pair's coverage by criterion."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, List, Sequence, Tuple

from benchmarks.coverage.selection import (
    CHECK_LAYER,
    RHOS,
    MismatchedSegment,
    SegmentCoverage,
    SegmentResult,
    coverage_entry,
    layer_mask,
    token_mask,
)
from benchmarks.fidelity.records import Run, RunRecord, TurnRecord
from benchmarks.fidelity_metrics import load_dump, safe_name
from sglang_kvshare.recompute import DroidSpeakProfile, entry_deviation, token_deviation


def segment_pairs(runs: Sequence[Run], dump_root: Path) -> Iterator[Tuple[RunRecord, TurnRecord, str, dict, dict]]:
    """(run, turn, slot, reused dump, exact dump) of every reused segment of a later agent."""
    for run in runs:
        if not isinstance(run, RunRecord):
            continue
        for turn in run.turns:
            if turn.position == 0 or turn.shadow is None:
                continue
            for err in turn.shadow.seg_errors or ():
                if err.mode != "injected" or err.error is None:
                    continue
                name = f"{safe_name(err.slot)}.pt"
                reused = dump_root / safe_name(run.workflow) / safe_name(turn.agent) / name
                exact = dump_root / safe_name(run.shadow_workflow) / safe_name(turn.agent) / name
                yield run, turn, err.slot, load_dump(reused), load_dump(exact)


def flat(dump) -> tuple:
    """(k, v) as ``[num_layers, n, kv_heads * head_dim]`` float32."""
    k, v = dump["k"].float(), dump["v"].float()
    return k.reshape(k.shape[0], k.shape[1], -1), v.reshape(v.shape[0], v.shape[1], -1)


class AttentionReader:
    """Attention importance of prompt tokens from a transformers forward of the same ids."""

    def __init__(self, model_path: str):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.tok = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, torch_dtype=torch.float32, attn_implementation="eager"
        ).eval()
        self._last: tuple = (None, None)  # (key, result): pairs of one turn come in a row

    def prompt(self, run: RunRecord, turn: TurnRecord):
        """The turn's prompt ids and spans, tokenised as the server does (exact output ids for
        the ``out:<agent>`` slots)."""
        from sglang_kvshare.integration.server.annotate import exact_output_ids, special_prefix
        from sglang_kvshare.segments import parse_annotation, tokenize_segments

        outputs = {t.agent: t for t in run.turns}

        def slot_tokens(slot: str, text: str):
            prev = outputs.get(slot[len("out:") :]) if slot.startswith("out:") else None
            if prev is None or prev.text != text:
                return None
            return exact_output_ids(self.tok, list(prev.output_ids), text)

        ann = parse_annotation(turn.payload_kvshare, "nonshared")
        return tokenize_segments(
            ann.segments, lambda t: self.tok.encode(t, add_special_tokens=False), special_prefix(self.tok), slot_tokens
        )

    def importance(self, run: RunRecord, turn: TurnRecord):
        """(prompt ids, float [prompt_len]): attention each position receives from the prompt's
        tokens after its last shared segment, mean over layers, heads and those queries."""
        key = f"{run.workflow}/{turn.agent}"
        if self._last[0] != key:
            torch = self.torch
            prompt = self.prompt(run, turn)
            last = max(s.end for s in prompt.spans if s.slot is not None)
            ids = torch.tensor([prompt.input_ids])
            with torch.no_grad():
                att = self.model(ids, output_attentions=True).attentions  # L x [1, H, T, T]
            mass = torch.stack([a[0, :, last:, :].mean(dim=(0, 1)) for a in att]).mean(0)
            self._last = (key, (prompt.input_ids, mass))
        return self._last[1]


def analyse_coverage(
    runs: Sequence[Run], dump_root: Path, profile: DroidSpeakProfile, reader: AttentionReader
) -> List[SegmentResult]:
    out: List[SegmentResult] = []
    for run, turn, slot, reused, exact in segment_pairs(runs, dump_root):
        r, e = flat(reused), flat(exact)
        errors = entry_deviation(r, e)  # [L, n]
        num_layers, n = errors.shape
        ids, mass = reader.importance(run, turn)
        start = exact["start"]
        if list(ids[start : start + n]) != list(exact["token_ids"]):
            out.append(MismatchedSegment(run.task_id, turn.agent, slot))
            continue
        dev = token_deviation((r[0][CHECK_LAYER], r[1][CHECK_LAYER]), (e[0][CHECK_LAYER], e[1][CHECK_LAYER]))
        att = mass[start : start + n]
        by_rho = {}
        for rho in RHOS:
            ratio = round(1.0 - rho, 6)
            masks = {
                "layer": layer_mask(profile, ratio, n),
                "deviation": token_mask(dev, ratio, num_layers),
                "attention": token_mask(att, ratio, num_layers),
            }
            by_rho[rho] = {c: coverage_entry(errors, m) for c, m in masks.items()}
        rel_err = float((errors.sum() / sum(x.pow(2).sum() for x in e)).sqrt())
        out.append(SegmentCoverage(run.task_id, turn.agent, slot, n, rel_err, by_rho))
    return out


def build_profile(runs: Sequence[Run], dump_root: Path) -> DroidSpeakProfile:
    profile = None
    for _, _, _, reused, exact in segment_pairs(runs, dump_root):
        r, e = flat(reused), flat(exact)
        if profile is None:
            profile = DroidSpeakProfile(r[0].shape[0])
        profile.accumulate(r, e)
    if profile is None:
        raise RuntimeError("no reused segment in the profiling runs")
    return profile
