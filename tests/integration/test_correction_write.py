"""The two ways a corrected segment reaches the KV pool agree: materialised and rotated once for all
layers (the CPU path) and the fused ``kernels.kv_correct`` per layer (the CUDA path, here through
its torch reference), on a real SGLang KV pool; chained (source rows) and non-chained
(reference rows for the corrected prefix, source rows beyond)."""

from __future__ import annotations

import pytest
import torch

from sglang_kvshare.correction import SegmentKV
from sglang_kvshare.correction.base import KVDelta, apply_delta
from sglang_kvshare.rope import RopeSpec, inv_freq_for

LAYERS, HEADS, HEAD_DIM, N = 3, 2, 16, 10


@pytest.fixture()
def pool():
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    p = MHATokenToKVPool(128, 1, torch.float32, HEADS, HEAD_DIM, LAYERS, "cpu", False)
    g = torch.Generator().manual_seed(0)
    for layer in range(LAYERS):
        p.get_key_buffer(layer).copy_(torch.randn(p.get_key_buffer(layer).shape, generator=g))
        p.get_value_buffer(layer).copy_(torch.randn(p.get_value_buffer(layer).shape, generator=g))
    return p


@pytest.mark.parametrize("chained", [True, False])
def test_fused_write_equals_materialised_write(pool, chained):
    from sglang_kvshare.integration.cache.kv_io import gather_canonical, write_canonical, write_fused

    rope = RopeSpec(inv_freq_for(HEAD_DIM, 10000.0), HEAD_DIM, True)
    src_idx, src_start = torch.arange(1, 1 + N), 40
    ref_idx, ref_start = torch.arange(20, 20 + N), 0
    start, k = 77, 7  # the target segment's position; rows a correction covers
    g = torch.Generator().manual_seed(1)
    delta = KVDelta(
        torch.randn(LAYERS, k, HEADS * HEAD_DIM, generator=g), torch.randn(LAYERS, k, HEADS * HEAD_DIM, generator=g)
    )
    source = gather_canonical(pool, src_idx, src_start, rope)
    base = source if chained else gather_canonical(pool, ref_idx, ref_start, rope)
    want = apply_delta(base, source, delta, k)
    write_canonical(pool, torch.arange(60, 60 + N), want, start, rope)
    base_idx, base_start = (src_idx, src_start) if chained else (ref_idx, ref_start)
    rows = torch.cat([base_idx[:k], src_idx[k:]])
    ar = torch.arange(N)
    positions = torch.where(ar < k, base_start + ar, src_start + ar)
    write_fused(pool, torch.arange(90, 90 + N), rows, positions, delta, k, start, rope)
    for layer in range(LAYERS):
        for buf in (pool.get_key_buffer(layer), pool.get_value_buffer(layer)):
            torch.testing.assert_close(buf[90 : 90 + N], buf[60 : 60 + N], atol=1e-4, rtol=1e-4)
    # and what was written is the corrected cache at the target's positions
    torch.testing.assert_close(gather_canonical(pool, torch.arange(90, 90 + N), start, rope).v, want.v)
    assert isinstance(want, SegmentKV)
