"""The Triton kernels compiled for CUDA against their torch references (skipped without CUDA)."""

import pytest
import torch

from sglang_kvshare.kernels.kv_correct import kv_correct_reference, kv_correct_triton
from sglang_kvshare.rope import RopeSpec, inv_freq_for

pytestmark = pytest.mark.gpu


def test_kv_correct_triton_on_cuda_matches_reference():
    g = torch.Generator().manual_seed(0)
    k = torch.randn(64, 3, 64, generator=g).cuda()
    v = torch.randn(64, 3, 64, generator=g).cuda()
    src = torch.arange(0, 20, device="cuda")
    dst = torch.arange(30, 50, device="cuda")
    spec = RopeSpec(inv_freq_for(64, 100000.0), 64, True)
    k_ref, v_ref = k.clone(), v.clone()
    kv_correct_reference(k_ref, v_ref, src, dst, 1234, spec)
    kv_correct_triton(k, v, src, dst, 1234, spec)
    torch.testing.assert_close(k, k_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(v, v_ref)


def _cuda(x):
    if isinstance(x, torch.Tensor):
        return x.cuda()
    if isinstance(x, tuple) and hasattr(x, "_replace"):  # KeyLR, KeyShift, KVLeafRows
        return type(x)(*(_cuda(y) for y in x))
    return x


@pytest.mark.parametrize("shift", [True, False], ids=["views-with-leaves", "leaves-in-place"])
def test_flash_lora_triton_on_cuda_matches_reference(shift):
    """Flash-LoRA-Attention compiled for CUDA (value and key LR, key shifts, KV leaves) against
    the torch reference over corrected copies."""
    from sglang_kvshare.kernels.flash_lora_attention import flash_lora_attention_reference, flash_lora_attention_triton
    from tests.kernel_batches import leaf_batch

    views, key_shift, leaves, fixed, kw = leaf_batch(shift)
    agent = torch.tensor([1, 0], dtype=torch.int32)
    ref = flash_lora_attention_reference(*fixed, agent=agent, **kw)
    out = flash_lora_attention_triton(
        *_cuda(views),
        agent=agent.cuda(),
        key_shift=_cuda(key_shift),
        key_leaf=_cuda(leaves),
        **{k: _cuda(v) for k, v in kw.items()},
    )
    torch.testing.assert_close(out.cpu(), ref, atol=1e-4, rtol=1e-4)
