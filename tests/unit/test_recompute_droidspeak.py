import json

import pytest
import torch

from sglang_kvshare.recompute import DroidSpeakProfile, SelectionInputs, get_selector
from sglang_kvshare.recompute.droidspeak import best_layer_groups

NUM_LAYERS, SEG_LEN, D = 12, 10, 8


def _sample(seed, hot_layers, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    exact = torch.randn(NUM_LAYERS, SEG_LEN, D, generator=g) * scale
    reused = exact + 0.01 * torch.randn(NUM_LAYERS, SEG_LEN, D, generator=g) * scale
    for layer in hot_layers:
        reused[layer] += 0.5 * scale * torch.randn(SEG_LEN, D, generator=g)
    return reused, exact


def _profile(hot_layers, num_samples=3, relative=True):
    prof = DroidSpeakProfile(NUM_LAYERS, relative=relative)
    for s in range(num_samples):
        prof.accumulate(*_sample(s, hot_layers))
    return prof


def test_profile_ranks_planted_layers():
    prof = _profile([3, 4, 5])
    dev = prof.layer_deviation()
    assert dev.shape == (NUM_LAYERS,) and dev.dtype == torch.float64
    assert set(torch.topk(dev, 3).indices.tolist()) == {3, 4, 5}


def test_choose_groups_single_contiguous_group():
    prof = _profile([3, 4, 5])
    assert prof.choose_groups(3 / NUM_LAYERS, max_groups=1) == ((3, 6),)


def test_choose_groups_two_groups_and_budget():
    prof = _profile([1, 2, 8, 9])
    # 0.35 * 12 = 4.2 -> 4 layers
    assert prof.choose_groups(0.35, max_groups=2) == ((1, 3), (8, 10))
    one = prof.choose_groups(0.35, max_groups=1)
    assert len(one) == 1 and one[0][1] - one[0][0] == 4


def test_best_layer_groups_is_optimal_brute_force():
    import itertools

    g = torch.Generator().manual_seed(7)
    scores = torch.rand(8, generator=g).tolist()
    for budget in range(1, 6):
        for max_groups in (1, 2, 3):
            got = best_layer_groups(scores, budget, max_groups)
            assert sum(e - s for s, e in got) == budget and len(got) <= max_groups
            best = -1.0
            for combo in itertools.combinations(range(8), budget):
                runs = sum(1 for i, layer in enumerate(combo) if i == 0 or combo[i - 1] != layer - 1)
                if runs <= max_groups:
                    best = max(best, sum(scores[layer] for layer in combo))
            assert sum(scores[layer] for s, e in got for layer in range(s, e)) == pytest.approx(best)


def test_plan_recomputes_whole_segment_in_groups():
    prof = _profile([6, 7])
    p = prof.plan(2 / NUM_LAYERS, SEG_LEN, max_groups=1)
    assert p.layer_groups == ((6, 8),)
    assert p.mask[6:8].all() and not p.mask[:6].any() and not p.mask[8:].any()
    assert p.recomputed_token_layers == 2 * SEG_LEN
    entries = p.hidden_state_entries()
    assert list(entries) == [6] and entries[6].tolist() == list(range(SEG_LEN))


@pytest.mark.parametrize("ratio", [0.1, 0.3, 0.5, 0.8])
def test_budget_respected(ratio):
    prof = _profile([2, 9])
    p = prof.plan(ratio, SEG_LEN)
    layers = round(ratio * NUM_LAYERS + 1e-9)
    assert p.recomputed_token_layers == layers * SEG_LEN
    assert len(p.layer_groups) <= 2


def test_edge_ratios_and_selector():
    prof = _profile([2])
    assert prof.plan(0.0, SEG_LEN).is_empty
    dense = prof.plan(1.0, SEG_LEN)
    assert dense.is_dense and dense.layer_groups == ((0, NUM_LAYERS),)
    sel = get_selector("droidspeak", profile=prof, max_groups=1)
    p = sel.plan(1 / NUM_LAYERS, SelectionInputs(NUM_LAYERS, SEG_LEN))
    assert p.layer_groups == ((2, 3),)
    with pytest.raises(ValueError):
        sel.plan(0.5, SelectionInputs(NUM_LAYERS + 1, SEG_LEN))


def test_relative_profile_is_scale_free():
    # deep layers with large norms and the same relative error should not dominate a relative profile
    prof_rel = DroidSpeakProfile(NUM_LAYERS, relative=True)
    prof_abs = DroidSpeakProfile(NUM_LAYERS, relative=False)
    reused, exact = _sample(0, [2])
    reused[10:] *= 100.0
    exact[10:] *= 100.0
    prof_rel.accumulate(reused, exact)
    prof_abs.accumulate(reused, exact)
    assert prof_rel.choose_groups(1 / NUM_LAYERS) == ((2, 3),)
    assert prof_abs.choose_groups(1 / NUM_LAYERS) != ((2, 3),)


def test_state_dict_roundtrip():
    prof = _profile([4])
    again = DroidSpeakProfile.from_state_dict(prof.state_dict())
    assert torch.equal(again.layer_deviation(), prof.layer_deviation())
    with pytest.raises(ValueError):
        DroidSpeakProfile(3).layer_deviation()


def test_a_profile_of_the_wrong_model_is_refused(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"layer_deviation": [0.1, 0.2, 0.3]}))
    assert DroidSpeakProfile.load(str(path), 3).choose_groups(1 / 3) == ((2, 3),)
    with pytest.raises(ValueError, match="3 layers, the model has 30"):
        DroidSpeakProfile.load(str(path), 30)
