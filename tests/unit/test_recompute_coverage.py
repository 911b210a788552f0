import math

import pytest
import torch

from sglang_kvshare.recompute import DroidSpeakProfile, coverage, random_mask, random_mask_like, relative_coverage
from sglang_kvshare.recompute.cacheblend import plan as cacheblend_plan
from sglang_kvshare.recompute.random import plan as random_plan

NUM_LAYERS, SEG_LEN, D = 8, 50, 16


def _planted(seed=0):
    """5 of 50 tokens carry most of the reuse error in every layer."""
    g = torch.Generator().manual_seed(seed)
    exact = torch.randn(NUM_LAYERS, SEG_LEN, D, generator=g)
    reused = exact + 0.05 * torch.randn(NUM_LAYERS, SEG_LEN, D, generator=g)
    hot = [4, 9, 22, 30, 41]
    reused[:, hot] += torch.randn(NUM_LAYERS, len(hot), D, generator=g)
    return reused, exact, hot


def test_full_and_empty_masks():
    reused, exact, _ = _planted()
    full = torch.ones(NUM_LAYERS, SEG_LEN, dtype=torch.bool)
    assert coverage(reused, exact, full) == pytest.approx(1.0)
    assert coverage(reused, exact, ~full) == 0.0
    assert coverage(exact, exact, ~full) == 1.0  # no error to remove
    assert math.isnan(relative_coverage(reused, exact, ~full))


def test_coverage_is_squared_frobenius_fraction():
    reused, exact = torch.zeros(2, 2, 1), torch.zeros(2, 2, 1)
    reused[0, 0] = 1.0
    reused[1, 1] = 3.0  # squared errors 1 and 9
    mask = torch.zeros(2, 2, dtype=torch.bool)
    mask[1, 1] = True
    assert coverage(reused, exact, mask) == pytest.approx(0.9)
    assert coverage((reused, reused), (exact, exact), mask) == pytest.approx(0.9)


def test_deviation_selection_beats_random():
    reused, exact, hot = _planted()
    # run-time CacheBlend with a perfect check layer (recomputed == exact)
    p = cacheblend_plan(reused, exact, 0.1, NUM_LAYERS, check_layers=1)
    assert p.token_indices(NUM_LAYERS - 1).tolist() == hot
    cov = coverage(reused, exact, p.mask)
    rnd = coverage(reused, exact, random_plan(NUM_LAYERS, SEG_LEN, 0.1, unit="tokens").mask)
    assert cov > 0.9
    assert cov > 2 * rnd
    assert relative_coverage(reused, exact, p.mask) > 2.0


def test_layer_selection_beats_random():
    g = torch.Generator().manual_seed(3)
    exact = torch.randn(NUM_LAYERS, SEG_LEN, D, generator=g)
    reused = exact + 0.05 * torch.randn(NUM_LAYERS, SEG_LEN, D, generator=g)
    reused[5] += torch.randn(SEG_LEN, D, generator=g)
    prof = DroidSpeakProfile(NUM_LAYERS)
    prof.accumulate(reused, exact)
    p = prof.plan(1 / NUM_LAYERS, SEG_LEN)
    assert p.layer_groups == ((5, 6),)
    assert relative_coverage(reused, exact, p.mask) > 4.0


def test_random_matches_budget_and_is_seeded():
    for unit in ("tokens", "layers", "token_layers"):
        m = random_mask(NUM_LAYERS, SEG_LEN, 0.25, unit=unit, seed=1)
        assert m.dtype == torch.bool and m.shape == (NUM_LAYERS, SEG_LEN)
        # 0.25 * 50 = 12.5 -> 13 tokens; 0.25 * 8 = 2 layers; 0.25 * 400 = 100 entries
        expected = {"tokens": 13 * NUM_LAYERS, "layers": 2 * SEG_LEN, "token_layers": 100}[unit]
        assert int(m.sum()) == expected
        assert torch.equal(m, random_mask(NUM_LAYERS, SEG_LEN, 0.25, unit=unit, seed=1))
    a = random_mask(NUM_LAYERS, SEG_LEN, 0.25, seed=1)
    assert not torch.equal(a, random_mask(NUM_LAYERS, SEG_LEN, 0.25, seed=2))
    like = random_mask_like(a, seed=5)
    assert int(like.sum()) == int(a.sum())
    with pytest.raises(ValueError):
        random_mask(2, 2, 0.5, unit="heads")


def test_random_relative_coverage_near_one():
    reused, exact, _ = _planted()
    m = random_mask(NUM_LAYERS, SEG_LEN, 0.3, seed=123)
    assert 0.5 < relative_coverage(reused, exact, m, seeds=range(20)) < 1.6
