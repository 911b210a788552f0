"""The coverage benchmark's selection helpers and the fidelity reuse count of recomputed segments."""

import torch

from benchmarks.coverage.selection import (
    RHOS,
    CoverageEntry,
    MismatchedSegment,
    SegmentCoverage,
    coverage_entry,
    summarise_coverage,
    token_mask,
)
from benchmarks.fidelity_metrics import reuse_counts


def test_token_mask_takes_the_top_scores_in_every_layer():
    scores = torch.tensor([0.1, 5.0, 0.2, 3.0, 0.0])
    mask = token_mask(scores, 0.4, num_layers=3)
    assert mask.shape == (3, 5)
    assert mask.all(dim=0).tolist() == [False, True, False, True, False]
    assert not mask[:, [0, 2, 4]].any()


def test_coverage_entry_against_random_selection():
    errors = torch.zeros(2, 10)
    errors[:, 3] = 9.0  # all error on token 3
    errors[:, 5] = 1.0
    hit = coverage_entry(errors, token_mask(errors.sum(0), 0.1, 2))
    assert hit.coverage == 0.9 and hit.removed2 == 18.0 and hit.err2 == 20.0
    assert 0.0 <= hit.random < 0.9 and hit.relative > 1.0
    assert list(hit.to_json()) == ["coverage", "random", "relative", "err2", "removed2"]
    miss = coverage_entry(errors, token_mask(-errors.sum(0), 0.1, 2))
    assert miss.coverage == 0.0


def test_summary_pools_removed_error_over_segments():
    def entry(cov, err2):
        return CoverageEntry(coverage=cov, random=0.1, relative=cov / 0.1, err2=err2, removed2=cov * err2)

    pairs = [
        SegmentCoverage(
            "t", "a", "q", 4, 0.1, {r: {c: entry(cov, err2) for c in ("layer", "deviation", "attention")} for r in RHOS}
        )
        for cov, err2 in ((0.5, 1.0), (0.1, 3.0))
    ]
    pairs.append(MismatchedSegment("t", "b", "q"))
    s = summarise_coverage(pairs)
    assert s.segments == 2 and s.mismatched == 1
    row = s.by_rho[0.9]["layer"]
    assert abs(row.coverage_mean - 0.3) < 1e-12
    assert abs(row.coverage_pooled - (0.5 + 0.3) / 4.0) < 1e-12
    # the JSON keys of results/coverage.json
    out = s.to_json()
    assert list(out) == ["segments", "mismatched", "0.9", "0.8"]
    assert list(out["0.9"]["layer"]) == ["coverage_mean", "random_mean", "relative_mean", "coverage_pooled"]
    assert list(pairs[0].to_json()) == ["task_id", "agent", "slot", "tokens", "rel_err", "0.9", "0.8"]
    assert pairs[2].to_json() == {"task_id": "t", "agent": "b", "slot": "q", "mismatch": True}


def test_recomputed_segments_count_their_reused_token_layers():
    kv = {
        "segments": [
            {"shared": False, "tokens": 4, "mode": "computed"},
            {
                "shared": True,
                "tokens": 10,
                "mode": "recomputed",
                "source_tokens": 8,
                "token_layers": 80,
                "recomputed_token_layers": 20,
            },
            {"shared": True, "tokens": 6, "mode": "injected", "injected_tokens": 6},
            {"shared": True, "tokens": 5, "mode": "computed"},
        ]
    }
    reused, total = reuse_counts(kv)
    assert total == 21
    assert reused == 8 * 0.75 + 6
