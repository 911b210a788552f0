"""Attention over KV views (``kernels.offset_attention``) equals SDPA over re-rotated copies."""

import pytest
import torch
from torch.nn.functional import scaled_dot_product_attention

from sglang_kvshare.kernels.kv_leaf import KeyLeaf
from sglang_kvshare.kernels.offset_attention import key_plan, offset_decode_attention, offset_extend_attention
from sglang_kvshare.lowrank import LowRank
from sglang_kvshare.rope.align import RopeSpec, inv_freq_for, shift_keys

D = 16
ROPE = RopeSpec(inv_freq_for(D, 10000.0), D, True)


def _request(hq, hkv, seed=0):
    """A request of 700 positions: its own system prompt (0:100), a shared span read from a
    source whose keys sit 37 positions earlier (100:500), another from a source 250 positions
    later (500:620), its own tail (620:700). Returns (keys as a copy would hold them, the keys
    as cached in place, values, per-key shift, q)."""
    g = torch.Generator().manual_seed(seed)
    n = 700
    k_true = shift_keys(torch.randn(n, hkv, D, generator=g), torch.arange(n), ROPE)  # RoPE at the request's positions
    v = torch.randn(n, hkv, D, generator=g)
    shifts = torch.zeros(n, dtype=torch.int64)
    shifts[100:500], shifts[500:620] = 37, -250
    k_cached = shift_keys(k_true, -shifts, ROPE)  # where a view reads them: RoPE at the source's positions
    return k_true, k_cached, v, shifts, torch.randn(n, hq, D, generator=g)


@pytest.mark.parametrize("hq,hkv", [(6, 2), (4, 4)])
def test_extend_with_offsets_equals_sdpa_over_rerotated_copies(hq, hkv):
    k_true, k_cached, v, shifts, q_all = _request(hq, hkv)
    q_pos = torch.arange(650, 700)  # an extend of the last 50 tokens after a 650-token prefix
    q = shift_keys(q_all[650:], q_pos, ROPE)
    slots = torch.arange(700)
    out = offset_extend_attention(q, k_cached, v, slots, shifts, q_pos, D**-0.5, ROPE)
    mask = torch.arange(700)[None, :] <= q_pos[:, None]
    ref = scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k_true.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=mask,
        scale=D**-0.5,
        enable_gqa=hq != hkv,
    )[0].transpose(0, 1)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # negative control: the cached keys without their offsets attend to something else
    plain = offset_extend_attention(q, k_cached, v, slots, torch.zeros_like(shifts), q_pos, D**-0.5, ROPE)
    assert (plain - ref).abs().max() > 1e-3


def test_extend_with_offsets_keeps_the_causal_mask_inside_a_shifted_span():
    k_true, k_cached, v, shifts, q_all = _request(4, 2, seed=1)
    q_pos = torch.arange(200, 560)  # queries inside both shared spans: some see only part of them
    q = shift_keys(q_all[200:560], q_pos, ROPE)
    out = offset_extend_attention(q, k_cached, v, torch.arange(560), shifts[:560], q_pos, D**-0.5, ROPE)
    mask = torch.arange(560)[None, :] <= q_pos[:, None]
    ref = scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k_true[:560].transpose(0, 1)[None],
        v[:560].transpose(0, 1)[None],
        attn_mask=mask,
        scale=D**-0.5,
        enable_gqa=True,
    )[0].transpose(0, 1)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("hq,hkv", [(6, 2), (4, 4)])
def test_decode_with_offsets_equals_sdpa_over_rerotated_copies(hq, hkv):
    k_true, k_cached, v, shifts, q_all = _request(hq, hkv, seed=2)
    # the pool: the request's slots in a scattered order, the views' spans as long runs
    rows = 4096
    slots = torch.cat(
        [torch.arange(3000, 3100), torch.arange(500, 900), torch.arange(2000, 2120), torch.arange(3200, 3280)]
    )
    k_pool, v_pool = torch.zeros(rows, hkv, D), torch.zeros(rows, hkv, D)
    k_pool[slots], v_pool[slots] = k_cached, v
    q = shift_keys(q_all[699:], torch.tensor([699]), ROPE)[0]  # the decode token at position 699
    plan = key_plan(slots, shifts, ROPE)
    assert [(s, n) for s, n, _, _ in plan.runs] == [
        (500, 400)
    ] and plan.rest.numel() == 300  # the short span is turned per key
    out = offset_decode_attention(q, k_pool, v_pool, plan, D**-0.5, ROPE)
    ref = scaled_dot_product_attention(
        q[None, :, None], k_true.transpose(0, 1)[None], v.transpose(0, 1)[None], scale=D**-0.5, enable_gqa=hq != hkv
    )[0, :, 0]
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    unshifted = offset_decode_attention(
        q, k_pool, v_pool, key_plan(slots, torch.zeros_like(shifts), ROPE), D**-0.5, ROPE
    )
    assert (unshifted - ref).abs().max() > 1e-3


@pytest.mark.parametrize("rows", ["extend", "chosen"])
def test_keys_at_their_own_positions_equal_sdpa_under_the_prefix_mask(rows):
    """Shifts 0 (a request without views): the extend's own keys attended causally, or rows
    chosen for recomputation under a mask by position, equal SDPA over the gathered keys."""
    k_true, _, v, _, q_all = _request(6, 2, seed=3)
    q_pos = torch.arange(130, 700) if rows == "extend" else torch.tensor([140, 141, 300, 301, 302, 650, 699])
    q = shift_keys(q_all[q_pos], q_pos, ROPE)
    slots = torch.arange(700)
    out = offset_extend_attention(q, k_true, v, slots, torch.zeros(700, dtype=torch.int64), q_pos, D**-0.5, None)
    mask = torch.arange(700)[None, :] <= q_pos[:, None]
    ref = scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k_true.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=mask,
        scale=D**-0.5,
        enable_gqa=True,
    )[0].transpose(0, 1)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    unmasked = scaled_dot_product_attention(
        q.transpose(0, 1)[None], k_true.transpose(0, 1)[None], v.transpose(0, 1)[None], scale=D**-0.5, enable_gqa=True
    )[0].transpose(0, 1)
    assert (out - unmasked).abs().max() > 1e-3  # the mask matters: a query must not see later keys


def _leaf(hkv, n_layers=2, rank=3, seed=4, two=False):
    """A KV leaf on positions 120:480 (inside the first shared span) and 650:660 (the request's
    own tail), rank ``rank`` in each of ``n_layers`` layers; and its dense rows per layer. With
    ``two``: two leaves side by side (ranks ``rank`` and ``rank + 2``), the second on 300:480
    and 655:660, read through its rows in reverse (a run that gathers its leaf rows)."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.cat([torch.arange(120, 480), torch.arange(650, 660)])

    def factors(m, r):
        return [
            LowRank(0.3 * torch.randn(n_layers, m, r, generator=g), torch.randn(n_layers, r, hkv * D, generator=g))
            for _ in range(2)
        ]

    if not two:
        fk, fv = factors(len(pos), rank)
        leaf = KeyLeaf.single(pos, fk, fv)
    else:
        second = ((pos >= 300) & (pos < 480)) | (pos >= 655)
        which = second.long()
        rows = torch.empty_like(pos)
        rows[~second] = torch.arange(int((~second).sum()))
        rows[second] = torch.arange(int(second.sum())).flip(0)
        (k0, v0), (k1, v1) = factors(int((~second).sum()), rank), factors(int(second.sum()), rank + 2)
        leaf = KeyLeaf(pos, which, rows, (k0, k1), (v0, v1))
    dense = []
    for factors_ in (leaf.k, leaf.v):
        x = torch.zeros(n_layers, len(pos), hkv * D)
        for j, f in enumerate(factors_):
            x[:, leaf.which == j] = f.reconstruct()[:, leaf.rows[leaf.which == j]]
        dense.append(x.view(n_layers, len(pos), hkv, D))
    return leaf, dense


@pytest.mark.parametrize(
    "case,rank,two",
    [
        ("extend", 3, False),
        ("rows", 3, False),
        ("decode", 3, False),
        ("decode", 20, False),
        ("extend", 20, False),
        ("extend", 3, True),
        ("decode", 3, True),
    ],
)
def test_leaf_rows_equal_sdpa_over_corrected_copies(case, rank, two):
    """A KV leaf (a low-rank correction beside the cached K/V, keys in the cached rows' RoPE
    frame) attends as a copy holding the corrected K/V would, in every layer's factors, at ranks
    below and above the head size."""
    hq, hkv, layer = 6, 2, 1
    k_true, k_cached, v, shifts, q_all = _request(hq, hkv, seed=5)
    leaf, (dk, dv) = _leaf(hkv, rank=rank, two=two)
    k_fixed, v_fixed = k_cached.clone(), v.clone()
    k_fixed[leaf.pos] += dk[layer]
    v_fixed[leaf.pos] += dv[layer]
    k_ref = shift_keys(k_fixed, shifts, ROPE)  # the corrected keys as a copy at the request's positions
    slots = torch.arange(700)
    if case == "decode":
        q_pos = torch.tensor([699])
        q = shift_keys(q_all[699:], q_pos, ROPE)
        plan = key_plan(slots, shifts, ROPE, leaf=leaf)
        # the leaf's long span is a run attended in place with its leaf, the short one gathered
        runs = [(120, 180), (300, 180)] if two else [(120, 360)]
        assert [(s, n) for s, n, _, part in plan.runs if part is not None] == runs
        out = offset_decode_attention(q[0], k_cached, v, plan, D**-0.5, ROPE, layer)[None]
    else:
        q_pos = torch.arange(600, 700) if case == "extend" else torch.tensor([130, 131, 400, 655, 690])
        q = shift_keys(q_all[q_pos], q_pos, ROPE)
        out = offset_extend_attention(q, k_cached, v, slots, shifts, q_pos, D**-0.5, ROPE, leaf=leaf, layer=layer)
    mask = torch.arange(700)[None, :] <= q_pos[:, None]
    ref = scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k_ref.transpose(0, 1)[None],
        v_fixed.transpose(0, 1)[None],
        attn_mask=mask,
        scale=D**-0.5,
        enable_gqa=True,
    )[0].transpose(0, 1)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # negative control: another layer's factors correct the keys differently
    other = offset_extend_attention(q, k_cached, v, slots, shifts, q_pos, D**-0.5, ROPE, leaf=leaf, layer=0)
    assert (other - ref).abs().max() > 1e-3
