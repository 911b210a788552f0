import pytest
import torch

from sglang_kvshare.recompute import SelectionInputs, attention_mass, get_selector, middle_third
from sglang_kvshare.recompute.relaycaching import critical_layer_range, plan, relay_scores, widen

NUM_LAYERS, SEG_LEN = 12, 20


def _scores():
    dev = torch.full((SEG_LEN,), 0.1)
    att = torch.full((SEG_LEN,), 0.1)
    dev[[2, 7, 11, 15]] = 5.0  # high deviation
    att[[7, 11, 15, 19]] = 5.0  # high attention
    return dev, att


def test_scores_need_both_deviation_and_attention():
    dev, att = _scores()
    s = relay_scores(dev, att)
    assert s.max() == 1.0
    top = torch.topk(s, 3).indices.tolist()
    assert sorted(top) == [7, 11, 15]  # 2 (deviation only) and 19 (attention only) lose
    assert s[2] < s[7] and s[19] < s[7]


def test_middle_third():
    assert middle_third(12) == (4, 8)
    assert middle_third(32) == (10, 22)
    assert middle_third(2) == (0, 2)


def test_plan_picks_planted_tokens_in_middle_layers():
    dev, att = _scores()
    # 3 tokens x 4 middle layers = 12 token-layers = 0.05 * 240
    p = plan(dev, att, 12 / (SEG_LEN * NUM_LAYERS), NUM_LAYERS)
    assert p.layer_groups == ((4, 8),)
    assert p.recomputed_token_layers == 12
    for layer in range(4, 8):
        assert p.token_indices(layer).tolist() == [7, 11, 15]
    assert not p.mask[:4].any() and not p.mask[8:].any()
    entries = p.hidden_state_entries()
    assert list(entries) == [4] and entries[4].tolist() == [7, 11, 15]


@pytest.mark.parametrize("ratio", [0.01, 0.05, 0.1, 0.3, 0.5, 0.77, 0.95])
def test_budget_is_exact_in_token_layers(ratio):
    dev, att = _scores()
    p = plan(dev, att, ratio, NUM_LAYERS)
    assert p.recomputed_token_layers == int(ratio * SEG_LEN * NUM_LAYERS + 0.5)
    ((start, end),) = p.layer_groups
    assert not p.mask[:start].any() and not p.mask[end:].any()
    # each token's recomputed layers are contiguous from the range start
    for t in range(SEG_LEN):
        col = p.mask[:, t].tolist()
        n = sum(col)
        assert col[start : start + n] == [True] * n


def test_range_widens_when_budget_exceeds_it():
    dev, att = _scores()
    p = plan(dev, att, 0.5, NUM_LAYERS)  # 120 token-layers > 4 layers * 20 tokens
    ((start, end),) = p.layer_groups
    assert end - start == 6 and start <= 4 and end >= 8
    assert widen((4, 8), 20, NUM_LAYERS) == (0, NUM_LAYERS)
    assert widen((0, 2), 4, NUM_LAYERS) == (0, 4)


def test_edge_ratios():
    dev, att = _scores()
    assert plan(dev, att, 0.0, NUM_LAYERS).is_empty
    dense = plan(dev, att, 1.0, NUM_LAYERS)
    assert dense.is_dense and dense.layer_groups == ((0, NUM_LAYERS),)
    assert plan(None, None, 1.0, NUM_LAYERS, seg_len=SEG_LEN).is_dense


def test_critical_layer_range_from_profile():
    scores = torch.zeros(NUM_LAYERS)
    scores[[6, 7, 8, 9]] = 1.0
    assert critical_layer_range(scores) == (6, 10)
    assert critical_layer_range(torch.zeros(NUM_LAYERS)) == (4, 8)  # ties -> middle
    sel = get_selector("relaycaching", layer_scores=scores)
    dev, att = _scores()
    p = sel.plan(12 / 240, SelectionInputs(NUM_LAYERS, SEG_LEN, token_deviation=dev, attention_mass=att))
    assert p.layer_groups == ((6, 10),)


def test_attention_mass_reference():
    torch.manual_seed(0)
    q = torch.randn(3, 4, 8)  # 3 queries, 4 heads
    k = torch.randn(10, 2, 8)  # 2 kv heads (GQA)
    k[6] = q.mean(dim=(0, 1)) * 20  # key aligned with the queries draws the attention
    mass = attention_mass(q, k)
    assert mass.shape == (10,) and mass.sum().item() == pytest.approx(1.0, abs=1e-5)
    assert mass.argmax().item() == 6
    # brute force against per-head softmax
    ref = torch.zeros(10)
    for h in range(4):
        logits = q[:, h] @ k[:, h // 2].T / 8**0.5
        ref += logits.softmax(-1).sum(0)
    assert torch.allclose(mass, ref / 12, atol=1e-6)
