import pytest
import torch

from sglang_kvshare.recompute import (
    SELECTORS,
    RecomputePlan,
    SelectionInputs,
    compose,
    get_selector,
    num_selected,
    token_deviation,
)
from sglang_kvshare.recompute.base import stack_kv


def test_num_selected_rounds_half_up_and_clamps():
    assert num_selected(0.0, 7) == 0
    assert num_selected(1.0, 7) == 7
    assert num_selected(0.3, 10) == 3
    assert num_selected(0.25, 10) == 3  # 2.5 -> 3, not banker's 2
    assert num_selected(0.2, 2) == 0
    with pytest.raises(ValueError):
        num_selected(1.5, 10)
    with pytest.raises(ValueError):
        num_selected(-0.1, 10)


def test_plan_counts():
    mask = torch.zeros(4, 6, dtype=torch.bool)
    mask[1:3, 2] = True
    mask[0, 5] = True
    p = RecomputePlan(method="x", ratio=0.1, mask=mask)
    assert p.recomputed_token_layers == 3
    assert p.num_reused_token_layers == 21
    assert p.num_reused_tokens == 4
    assert p.num_recomputed_tokens == 2
    assert p.recompute_ratio == pytest.approx(3 / 24)
    assert p.rho == pytest.approx(1 - 3 / 24)
    assert p.token_indices(1).tolist() == [2]
    entries = p.hidden_state_entries()
    assert sorted(entries) == [0, 1]
    assert entries[0].tolist() == [5] and entries[1].tolist() == [2]


def test_plan_rejects_non_bool_mask():
    with pytest.raises(ValueError):
        RecomputePlan(method="x", ratio=0.0, mask=torch.zeros(2, 3))


def test_compose_is_eq3():
    reused, target = torch.zeros(2, 3, 4), torch.ones(2, 3, 4)
    mask = torch.tensor([[True, False, False], [False, False, True]])
    out = compose(reused, target, mask)
    assert out[0, 0].eq(1).all() and out[1, 2].eq(1).all()
    assert out.sum() == 8
    assert reused.sum() == 0


def test_kv_pair_is_concatenation():
    k, v = torch.randn(3, 5, 4), torch.randn(3, 5, 4)
    assert stack_kv((k, v)).shape == (3, 5, 8)
    dev = token_deviation((k[0], v[0]), (k[0] + 1, v[0] + 2))
    assert torch.allclose(dev, torch.full((5,), 4 * 1.0 + 4 * 4.0))


@pytest.mark.parametrize("name", ["cacheblend", "droidspeak", "relaycaching", "random"])
def test_registry_edge_ratios(name):
    sel = get_selector(name)
    assert sel.name == name and name in SELECTORS
    inputs = SelectionInputs(num_layers=5, seg_len=7)
    assert sel.plan(0.0, inputs).is_empty
    dense = sel.plan(1.0, inputs)
    assert dense.is_dense and dense.recomputed_token_layers == 35 and dense.rho == 0.0


def test_registry_unknown_and_missing_inputs():
    with pytest.raises(ValueError):
        get_selector("kvcomm")
    with pytest.raises(ValueError, match="recomputed_kv"):
        get_selector("cacheblend").plan(0.3, SelectionInputs(num_layers=4, seg_len=8))
    with pytest.raises(ValueError, match="DroidSpeakProfile"):
        get_selector("droidspeak").plan(0.3, SelectionInputs(num_layers=4, seg_len=8))
