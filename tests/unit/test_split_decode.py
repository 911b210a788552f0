"""Split-KV decode attention (``kernels.split_decode``) equals SDPA over the gathered slots."""

import pytest
import torch
from torch.nn.functional import scaled_dot_product_attention

from sglang_kvshare.kernels.split_decode import slot_runs, split_decode_attention

ROWS, D = 4096, 16


def _gathered(q, k_cache, v_cache, slots, scale):
    k = k_cache[slots].transpose(0, 1).unsqueeze(0)
    v = v_cache[slots].transpose(0, 1).unsqueeze(0)
    hq, hkv = q.shape[0], k_cache.shape[1]
    return scaled_dot_product_attention(q[None, :, None], k, v, scale=scale, enable_gqa=hq != hkv)[0, :, 0]


LAYOUTS = {
    # prefix run, injected segment, short suffix, scattered decode slots
    "fragmented": torch.cat(
        [torch.arange(3000, 3040), torch.arange(100, 700), torch.arange(2000, 2020), torch.arange(3500, 3548, 3)]
    ),
    "one-run": torch.arange(50, 900),
    "all-short": torch.randperm(ROWS, generator=torch.Generator().manual_seed(1))[:300],
    "two-long-runs-reversed": torch.cat([torch.arange(2000, 2300), torch.arange(10, 400)]),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("hq,hkv", [(6, 2), (4, 4)])
def test_split_decode_equals_gathered_sdpa(layout, hq, hkv):
    g = torch.Generator().manual_seed(0)
    k_cache, v_cache = torch.randn(ROWS, hkv, D, generator=g), torch.randn(ROWS, hkv, D, generator=g)
    q = torch.randn(hq, D, generator=g)
    slots = LAYOUTS[layout]
    parts = slot_runs(slots)
    out = split_decode_attention(q, k_cache, v_cache, parts, D**-0.5)
    torch.testing.assert_close(out, _gathered(q, k_cache, v_cache, slots, D**-0.5), atol=2e-6, rtol=1e-5)
    # negative control: leaving out the gathered rest (or a run) changes the result
    if parts.runs and parts.rest is not None:
        partial = split_decode_attention(q, k_cache, v_cache, parts._replace(rest=None), D**-0.5)
        assert not torch.allclose(partial, out, atol=1e-4)


def test_slot_runs_splits_long_runs_from_the_rest():
    parts = slot_runs(LAYOUTS["fragmented"], min_run=128)
    assert parts.runs == [(100, 600)]
    assert parts.rest.tolist() == [*range(3000, 3040), *range(2000, 2020), *range(3500, 3548, 3)]
    short = slot_runs(torch.arange(5, 9), min_run=128)  # all gathered
    assert short.runs == [] and short.rest.tolist() == [5, 6, 7, 8]
    assert slot_runs(torch.arange(0, 300), min_run=128).runs == [(0, 300)]
    assert slot_runs(torch.tensor([], dtype=torch.int64)) == ([], None)
