import pytest
import torch

from sglang_kvshare.recompute import SelectionInputs, get_selector
from sglang_kvshare.recompute.cacheblend import plan, select_tokens

NUM_LAYERS, SEG_LEN, D = 6, 40, 16
PLANTED = [3, 17, 18, 31]


def _caches(seed=0):
    g = torch.Generator().manual_seed(seed)
    recomputed = torch.randn(NUM_LAYERS, SEG_LEN, D, generator=g)
    reused = recomputed + 0.01 * torch.randn(NUM_LAYERS, SEG_LEN, D, generator=g)
    reused[:, PLANTED] += 3.0
    return reused, recomputed


def test_select_tokens_finds_planted():
    reused, recomputed = _caches()
    idx = select_tokens(reused[0], recomputed[0], len(PLANTED) / SEG_LEN)
    assert idx.dtype == torch.int64
    assert idx.tolist() == PLANTED


def test_select_tokens_uses_given_layer_only():
    reused, recomputed = _caches()
    reused[1, 5] += 100.0  # planted only in layer 1
    assert 5 not in select_tokens(reused[0], recomputed[0], 0.1).tolist()
    assert 5 in select_tokens(reused[1], recomputed[1], 0.1).tolist()


@pytest.mark.parametrize("check_layers", [1, 2])
def test_plan_mask_and_budget(check_layers):
    reused, recomputed = _caches()
    ratio = 0.1
    p = plan(reused, recomputed[:check_layers], ratio, NUM_LAYERS, check_layers=check_layers)
    k = 4  # round(0.1 * 40)
    assert p.mask[:check_layers].all()
    for layer in range(check_layers, NUM_LAYERS):
        assert p.token_indices(layer).tolist() == PLANTED
    assert p.recomputed_token_layers == check_layers * SEG_LEN + k * (NUM_LAYERS - check_layers)
    assert p.layer_groups == ((0, NUM_LAYERS),)
    # only embeddings are needed: every recomputed token starts at layer 0
    assert list(p.hidden_state_entries()) == [0]


def test_plan_with_kv_pairs():
    reused, recomputed = _caches()
    p = plan((reused, reused), (recomputed, recomputed), 0.1, NUM_LAYERS)
    assert p.token_indices(NUM_LAYERS - 1).tolist() == PLANTED


def test_edge_ratios():
    reused, recomputed = _caches()
    empty = plan(reused, recomputed, 0.0, NUM_LAYERS)
    assert empty.is_empty and empty.num_reused_tokens == SEG_LEN and empty.rho == 1.0
    dense = plan(reused, recomputed, 1.0, NUM_LAYERS)
    assert dense.is_dense and dense.recomputed_token_layers == NUM_LAYERS * SEG_LEN
    assert plan(None, None, 1.0, NUM_LAYERS, seg_len=9).is_dense


def test_selector_matches_function():
    reused, recomputed = _caches()
    inputs = SelectionInputs(NUM_LAYERS, SEG_LEN, reused_kv=reused, recomputed_kv=recomputed[:1])
    p = get_selector("cacheblend").plan(0.1, inputs)
    assert torch.equal(p.mask, plan(reused, recomputed[:1], 0.1, NUM_LAYERS).mask)
    with pytest.raises(ValueError):
        plan(reused, recomputed, 0.1, NUM_LAYERS, check_layers=0)
