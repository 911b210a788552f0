"""Flash-LoRA-Attention Triton kernel vs its torch reference (CPU: Triton interpreter).

The interpreter must be on before triton is first imported. When another module of the session
imported triton earlier (e.g. through sglang), the kernel tests run in a fresh subprocess instead.
"""

import os
import subprocess
import sys

_LATE = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from sglang_kvshare.kernels import flash_lora_attention as fla  # noqa: E402
from sglang_kvshare.lora_cache import LoRAProjection, lora_attention_naive, lr_values  # noqa: E402
from sglang_kvshare.rope.align import RopeSpec, inv_freq_for, shift_keys  # noqa: E402
from tests.kernel_batches import HKV, HQ, SLOTS, D, R, leaf_batch  # noqa: E402
from tests.kernel_batches import paged_batch as _batch  # noqa: E402
from tests.kernel_batches import views_batch as _views_batch  # noqa: E402

torch.set_num_threads(1)
IN_SUBPROCESS = not torch.cuda.is_available() and _LATE
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)
kernel_test = pytest.mark.skipif(IN_SUBPROCESS, reason="run by test_kernels_in_fresh_process")


def test_kernels_in_fresh_process():
    if not IN_SUBPROCESS:
        pytest.skip("triton interpreter active in this process")
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]


PAGED_CASES = pytest.mark.parametrize(
    "q_lens,kv_lens,agents",
    [
        ([5, 1, 3], [12, 9, 3], [2, 0, 1]),  # extend with prefix, decode, prefill
        ([1, 1], [17, 5], [1, -1]),  # decode batch, one base-model request
    ],
    ids=["extend-decode-prefill", "decode-base"],
)
ATOL = 2e-5


@kernel_test
@PAGED_CASES
def test_triton_matches_reference(q_lens, kv_lens, agents):
    args, kw = _batch(q_lens, kv_lens)
    agent = torch.tensor(agents, dtype=torch.int32)
    out = fla.flash_lora_attention_triton(*args, agent=agent, **kw)
    ref = fla.flash_lora_attention_reference(*args, agent=agent, **kw)
    assert out.shape == args[0].shape
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=1e-5)
    # negative control: without the LR cache the kernel gives a different (base) output
    base = fla.flash_lora_attention_triton(*args, agent=agent)
    assert (base - out).abs().max() > 1e-2


@kernel_test
def test_triton_equals_ordinary_lora_attention():
    """End to end with real LR values: one request, 4 new tokens after a prefix of 6."""
    g = torch.Generator().manual_seed(3)
    T, hidden = 10, 32
    x = torch.randn(T, hidden, generator=g)
    W_v = torch.randn(hidden, HKV * D, generator=g) / hidden**0.5
    ad = LoRAProjection(
        torch.randn(R, hidden, generator=g) / hidden**0.5, torch.randn(R, HKV * D, generator=g) * 0.5, 2.0
    )
    k = torch.randn(T, HKV, D, generator=g)
    q = torch.randn(4, HQ, D, generator=g)
    lr_buf = lr_values(x, ad.A, ad.scaling)[:, None, :].contiguous()  # [T, 1 agent, R]
    out = fla.flash_lora_attention_triton(
        q,
        k,
        (x @ W_v).view(T, HKV, D),
        torch.arange(T, dtype=torch.int32),
        torch.tensor([0, 4], dtype=torch.int32),
        torch.tensor([0, T], dtype=torch.int32),
        lr_buf,
        ad.B[None].contiguous(),
        torch.tensor([0], dtype=torch.int32),
    )
    ref = lora_attention_naive(q, k, (x @ W_v + ad.delta(x)).view(T, HKV, D), None, None)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=1e-5)


@kernel_test
def test_triton_key_lr_matches_reference():
    args, kw = _batch([3, 1], [7, 6], seed=1, key_lr=True)
    agent = torch.tensor([0, 2], dtype=torch.int32)
    out = fla.flash_lora_attention_triton(*args, agent=agent, **kw)
    ref = fla.flash_lora_attention_reference(*args, agent=agent, **kw)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=1e-5)
    no_key = fla.flash_lora_attention_triton(*args, agent=agent, lr_buf=kw["lr_buf"], B_v=kw["B_v"])
    assert (no_key - out).abs().max() > 1e-3

    # the reference's key path is ordinary RoPE'd LoRA keys: K = RoPE(K_pre + LR_k B_k)
    q, k_buf, v_buf, kv_idx, _, _ = args
    slots, j = kv_idx[7:13].long(), 2
    lr_k, B_k, rope = kw["key_lr"]
    pos = torch.arange(6)
    k_pre = torch.randn(6, HKV, D, generator=torch.Generator().manual_seed(4))
    k_buf = k_buf.clone()
    k_buf[slots] = shift_keys(k_pre, pos, rope)
    k_lora = shift_keys(k_pre + (lr_k[slots, j] @ B_k[j]).view(6, HKV, D), pos, rope)
    v_lora = v_buf[slots] + (kw["lr_buf"][slots, j] @ kw["B_v"][j]).view(6, HKV, D)
    one = fla.flash_lora_attention_triton(
        q[3:4],
        k_buf,
        v_buf,
        kv_idx[7:13],
        torch.tensor([0, 1], dtype=torch.int32),
        torch.tensor([0, 6], dtype=torch.int32),
        agent=torch.tensor([j], dtype=torch.int32),
        **kw,
    )
    torch.testing.assert_close(one, lora_attention_naive(q[3:4], k_lora, v_lora, None, None), atol=ATOL, rtol=1e-5)


@kernel_test
@pytest.mark.parametrize("key_lr", [False, True], ids=["value-lr", "key-and-value-lr"])
def test_triton_key_shift_equals_attention_over_rerotated_copies(key_lr):
    copies, views, key_shift, kw = _views_batch(key_lr)
    agent = torch.tensor([1, 0], dtype=torch.int32)
    ref = fla.flash_lora_attention_reference(*copies, agent=agent, **kw)
    out = fla.flash_lora_attention_triton(*views, agent=agent, key_shift=key_shift, **kw)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=1e-5)
    for path in (fla.flash_lora_attention_reference, fla.flash_lora_attention_sdpa):
        torch.testing.assert_close(path(*views, agent=agent, key_shift=key_shift, **kw), ref, atol=ATOL, rtol=1e-5)
    # negative control: the views' keys without their shifts attend to something else
    assert (fla.flash_lora_attention_triton(*views, agent=agent, **kw) - ref).abs().max() > 1e-3
    # base-model requests (no LR) take the shift too
    base = fla.flash_lora_attention_triton(*views, key_shift=key_shift)
    torch.testing.assert_close(base, fla.flash_lora_attention_reference(*copies), atol=ATOL, rtol=1e-5)


@kernel_test
@pytest.mark.parametrize("shift", [True, False], ids=["views-with-leaves", "leaves-in-place"])
def test_triton_leaves_equal_attention_over_corrected_copies(shift):
    """KV leaves in the kernel: keys and values read through their leaf rows (keys in the cached
    rows' frame, turned after) attend as corrected copies at the readers' positions would."""
    views, key_shift, leaves, fixed, kw = leaf_batch(shift)
    agent = torch.tensor([1, 0], dtype=torch.int32)
    ref = fla.flash_lora_attention_reference(*fixed, agent=agent, **kw)
    out = fla.flash_lora_attention_triton(*views, agent=agent, key_shift=key_shift, key_leaf=leaves, **kw)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=1e-5)
    for path in (fla.flash_lora_attention_reference, fla.flash_lora_attention_sdpa):
        torch.testing.assert_close(
            path(*views, agent=agent, key_shift=key_shift, key_leaf=leaves, **kw), ref, atol=ATOL, rtol=1e-5
        )
    # negative controls: without the leaves, or with the second leaf's B swapped in for the first
    assert (fla.flash_lora_attention_triton(*views, agent=agent, key_shift=key_shift, **kw) - ref).abs().max() > 1e-3
    swapped = leaves._replace(B_v=leaves.B_v.flip(0))
    assert (
        fla.flash_lora_attention_triton(*views, agent=agent, key_shift=key_shift, key_leaf=swapped, **kw) - ref
    ).abs().max() > 1e-3


@kernel_test
def test_leaf_table_indexes_each_requests_leaves():
    leaf = torch.tensor([-1, 4, 4, 2, -1, 2, 7, -1])
    table, which = fla.leaf_table(leaf, torch.tensor([0, 5, 5, 8], dtype=torch.int32))
    assert table.tolist() == [[2, 4], [-1, -1], [2, 7]]
    assert which.tolist() == [-1, 1, 1, 0, -1, 0, 1, -1]


@kernel_test
def test_kernel_reads_the_cpu_paths_leaves_as_it_does():
    """The CPU serving path's leaves (``KeyLeaf``: two leaves of ranks 3 and 5 on one request,
    one read through reversed rows) given to the Triton kernel (``leaf_rows``) attend as the CPU
    path does; a second request reading the same factors stacks them once."""
    from sglang_kvshare.kernels.kv_leaf import leaf_rows
    from sglang_kvshare.kernels.offset_attention import offset_extend_attention
    from tests.unit.test_offset_attention import D as D_, ROPE, _leaf, _request

    hq, hkv, layer = 6, 2, 1
    _, k_cached, v, shifts, q_all = _request(hq, hkv, seed=5)
    leaf, _ = _leaf(hkv, rank=3, two=True)
    q_pos = [torch.arange(640, 700), torch.tensor([699])]
    q = torch.cat([shift_keys(q_all[p], p, ROPE) for p in q_pos])
    rows = leaf_rows([leaf, leaf], [700, 700], layer)
    assert rows.B_k.shape == (2, 5, hkv * D_)  # two distinct leaves, rank padded to the largest
    slots = torch.arange(700, dtype=torch.int32)
    out = fla.flash_lora_attention_triton(
        q,
        k_cached,
        v,
        torch.cat([slots, slots]),
        torch.tensor([0, 60, 61], dtype=torch.int32),
        torch.tensor([0, 700, 1400], dtype=torch.int32),
        scale=D_**-0.5,
        key_shift=fla.KeyShift(torch.cat([shifts, shifts]), ROPE),
        key_leaf=rows,
        block_m=64,
        block_n=64,
    )
    for (q0, q1), p in zip(((0, 60), (60, 61)), q_pos):
        ref = offset_extend_attention(
            q[q0:q1], k_cached, v, slots.long(), shifts, p, D_**-0.5, ROPE, leaf=leaf, layer=layer
        )
        torch.testing.assert_close(out[q0:q1], ref, atol=ATOL, rtol=1e-5)
    assert leaf_rows([None, None], [700, 700], layer) is None


@kernel_test
def test_dispatcher_uses_reference_on_cpu():
    args, kw = _batch([2], [4], seed=2)
    out = fla.flash_lora_attention_paged(*args, agent=torch.tensor([1]), **kw)
    torch.testing.assert_close(out, fla.flash_lora_attention_reference(*args, agent=torch.tensor([1]), **kw))


@kernel_test
def test_launcher_asserts_shapes():
    args, kw = _batch([2], [4], seed=2)
    with pytest.raises(AssertionError):
        fla.flash_lora_attention_triton(*args, lr_buf=kw["lr_buf"], B_v=kw["B_v"][:, :4])


@PAGED_CASES
def test_sdpa_serving_path_matches_reference(q_lens, kv_lens, agents):
    """The torch path the kvshare_torch backend runs on the CPU (LR as extra value channels of
    one SDPA call) equals the reference, and equals ordinary LoRA attention per request."""
    args, kw = _batch(q_lens, kv_lens, seed=3)
    agent = torch.tensor(agents, dtype=torch.int32)
    out = fla.flash_lora_attention_sdpa(*args, agent=agent, **kw)
    torch.testing.assert_close(out, fla.flash_lora_attention_reference(*args, agent=agent, **kw), atol=ATOL, rtol=1e-5)
    q, k_buf, v_buf, kv_indices, qo, kvp = args
    for b, j in enumerate(agents):
        slots = kv_indices[kvp[b] : kvp[b + 1]].long()
        lr = kw["lr_buf"][slots, j] if j >= 0 else None
        naive = lora_attention_naive(
            q[qo[b] : qo[b + 1]], k_buf[slots], v_buf[slots], lr, kw["B_v"][j] if j >= 0 else None
        )
        torch.testing.assert_close(out[qo[b] : qo[b + 1]], naive, atol=ATOL, rtol=1e-5)
    # negative control: dropping the LR term changes the adapted requests
    base = fla.flash_lora_attention_sdpa(*args)
    assert not torch.allclose(base[: q_lens[0]], out[: q_lens[0]], atol=1e-3)


@PAGED_CASES
def test_sdpa_serving_path_with_key_lr_matches_reference(q_lens, kv_lens, agents):
    """The CPU serving path with a key LR cache (QKVO adapters) equals the reference, and per
    request the ordinary LoRA attention over K = RoPE(K_pre + LR_k B_k), V = V_base + LR_v B_v."""
    args, kw = _batch(q_lens, kv_lens, seed=5, key_lr=True)
    agent = torch.tensor(agents, dtype=torch.int32)
    q, k_buf, v_buf, kv_indices, qo, kvp = args
    lr_k, B_k, rope = kw["key_lr"]
    k_pre = torch.randn(SLOTS, HKV, D, generator=torch.Generator().manual_seed(6))
    k_buf = k_buf.clone()
    for b in range(len(q_lens)):  # base keys rotated at their index in the request
        slots = kv_indices[kvp[b] : kvp[b + 1]].long()
        k_buf[slots] = shift_keys(k_pre[slots], torch.arange(len(slots)), rope)
    args = (q, k_buf, v_buf, kv_indices, qo, kvp)
    out = fla.flash_lora_attention_sdpa(*args, agent=agent, **kw)
    torch.testing.assert_close(out, fla.flash_lora_attention_reference(*args, agent=agent, **kw), atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(fla.flash_lora_attention_paged(*args, agent=agent, **kw), out)
    for b, j in enumerate(agents):
        slots = kv_indices[kvp[b] : kvp[b + 1]].long()
        pos = torch.arange(len(slots))
        k = k_buf[slots] if j < 0 else shift_keys(k_pre[slots] + (lr_k[slots, j] @ B_k[j]).view(-1, HKV, D), pos, rope)
        v = v_buf[slots] if j < 0 else v_buf[slots] + (kw["lr_buf"][slots, j] @ kw["B_v"][j]).view(-1, HKV, D)
        torch.testing.assert_close(
            out[qo[b] : qo[b + 1]], lora_attention_naive(q[qo[b] : qo[b + 1]], k, v, None, None), atol=ATOL, rtol=1e-5
        )
    # negative control: without the key LR term the adapted requests' outputs change
    no_key = fla.flash_lora_attention_sdpa(*args, agent=agent, lr_buf=kw["lr_buf"], B_v=kw["B_v"])
    assert not torch.allclose(no_key[: q_lens[0]], out[: q_lens[0]], atol=1e-3)


@pytest.mark.parametrize("is_neox,rotary_dim", [(True, D), (False, D), (True, D // 2)])
def test_rotate_key_delta_equals_expand_key_lr(is_neox, rotary_dim):
    from sglang_kvshare.kernels.flash_lora_torch import rotate_key_delta
    from sglang_kvshare.lora_cache import expand_key_lr

    g = torch.Generator().manual_seed(7)
    rope = RopeSpec(inv_freq_for(rotary_dim, 10000.0), rotary_dim, is_neox=is_neox)
    lr_k, B_k = torch.randn(300, R, generator=g), torch.randn(R, HKV * D, generator=g)
    for n in (5, 300):  # the cached table grows
        got = rotate_key_delta(lr_k[:n], B_k, HKV, rope)
        torch.testing.assert_close(got, expand_key_lr(lr_k[:n], B_k, HKV, torch.arange(n), rope), atol=1e-4, rtol=1e-5)
    assert not torch.allclose(got, (lr_k @ B_k).view(300, HKV, D), atol=1e-2)


@PAGED_CASES
def test_sdpa_serving_path_runs_the_fused_kernel(q_lens, kv_lens, agents):
    """With SDPA restricted to its fused (flash) kernel the serving path still runs and gives the
    same output: the LR channels must not push it onto the math path, which materialises the
    [Hq, q, kv] scores (hundreds of MB per layer at 2K tokens)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    args, kw = _batch(q_lens, kv_lens, seed=7)
    agent = torch.tensor(agents, dtype=torch.int32)
    ref = fla.flash_lora_attention_reference(*args, agent=agent, **kw)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        out = fla.flash_lora_attention_sdpa(*args, agent=agent, **kw)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=1e-5)
