"""RoPE re-alignment is exact against an independent implementation (transformers' Llama RoPE)."""

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from sglang_kvshare.rope import RopeSpec, inv_freq_for, shift_keys

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 1024,
}


def _hf_keys(raw, positions, head_dim, theta, scaling):
    params = {"rope_type": "default", "rope_theta": theta}
    if scaling:
        params = dict(scaling, rope_theta=theta)
    cfg = LlamaConfig(
        hidden_size=head_dim * 2,
        num_attention_heads=2,
        head_dim=head_dim,
        max_position_embeddings=65536,
        rope_parameters=params,
    )
    rot = LlamaRotaryEmbedding(cfg)
    # raw: [T, H, D] -> HF layout [1, H, T, D]; HF's inv_freq (with its llama3 scaling) and its
    # rotate_half, but angles in float64 (HF's own float32 angles drift at large positions)
    x = raw.transpose(0, 1)[None].double()
    ang = positions.double()[:, None] * rot.inv_freq.double()[None, :]
    emb = torch.cat((ang, ang), dim=-1)[None]
    _, k = apply_rotary_pos_emb(x, x, emb.cos(), emb.sin())
    return k[0].transpose(0, 1), rot.inv_freq


@pytest.mark.parametrize("scaling", [None, LLAMA3], ids=["default", "llama3"])
@pytest.mark.parametrize("delta", [37, -5, 3000])
def test_shifted_keys_equal_keys_computed_at_the_new_position(scaling, delta):
    torch.manual_seed(0)
    head_dim, theta, T = 64, 500000.0, 50
    raw = torch.randn(T, 3, head_dim, dtype=torch.float64)
    pos = torch.arange(100, 100 + T)
    k_at_p, hf_inv_freq = _hf_keys(raw, pos, head_dim, theta, scaling)
    k_at_pd, _ = _hf_keys(raw, pos + delta, head_dim, theta, scaling)
    spec = RopeSpec(inv_freq=inv_freq_for(head_dim, theta, scaling), rotary_dim=head_dim, is_neox=True)
    torch.testing.assert_close(spec.inv_freq, hf_inv_freq.float(), rtol=0, atol=0)
    moved = shift_keys(k_at_p.float(), delta, spec)
    torch.testing.assert_close(moved, k_at_pd.float(), atol=2e-5, rtol=1e-5)
    # a wrong delta is far off: the test can fail
    assert (shift_keys(k_at_p.float(), delta + 1, spec) - k_at_pd.float()).abs().max() > 1e-2


def test_per_token_delta_and_partial_rotary_dim_and_gptj_layout():
    torch.manual_seed(1)
    spec = RopeSpec(inv_freq=inv_freq_for(32, 10000.0), rotary_dim=32, is_neox=False)
    k = torch.randn(6, 2, 48)
    deltas = torch.tensor([0, 1, 2, 3, 4, 5])
    out = shift_keys(k, deltas, spec)
    assert torch.equal(out[..., 32:], k[..., 32:])  # channels past rotary_dim are untouched
    torch.testing.assert_close(out[0], k[0])
    back = shift_keys(out, -deltas, spec)
    torch.testing.assert_close(back, k, atol=1e-5, rtol=1e-5)
    # GPT-J pairs are interleaved: rotating by 1 mixes channels 0 and 1
    one = shift_keys(k[:1], 1, spec)
    ang = spec.inv_freq[0].item()
    import math

    x0, x1 = k[0, 0, 0].item(), k[0, 0, 1].item()
    assert one[0, 0, 0].item() == pytest.approx(x0 * math.cos(ang) - x1 * math.sin(ang), abs=1e-5)


def test_unsupported_scaling_is_refused():
    with pytest.raises(ValueError, match="yarn"):
        inv_freq_for(64, 10000.0, {"rope_type": "yarn", "factor": 4.0})


@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("delta", [0, 7, -2048])
def test_in_place_constant_shift_equals_the_per_token_shift(is_neox, delta):
    """``rotate_keys_`` (one angle, in place, any leading layout) equals ``shift_keys`` with a
    per-token delta tensor (the general path), channels past rotary_dim untouched."""
    from sglang_kvshare.rope import rotate_keys_

    torch.manual_seed(2)
    spec = RopeSpec(inv_freq=inv_freq_for(32, 10000.0), rotary_dim=32, is_neox=is_neox)
    k = torch.randn(4, 9, 2, 48)  # [layers, tokens, heads, head_dim]
    expected = shift_keys(k.reshape(-1, 2, 48), torch.full((36,), delta), spec).reshape(k.shape)
    out = k.clone()
    assert rotate_keys_(out, delta, spec) is out
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[..., 32:], k[..., 32:])
    if delta:
        assert (rotate_keys_(k.clone(), delta + 1, spec) - expected).abs().max() > 1e-2
    with pytest.raises(TypeError, match="float32"):
        rotate_keys_(k.to(torch.bfloat16), delta, spec)
