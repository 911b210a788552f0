"""Triton kv_correct kernel (through the Triton interpreter on CPU) vs its torch reference."""

import os
import subprocess
import sys
from pathlib import Path

# Triton reads TRITON_INTERPRET when it (and each @jit function) is first imported; if another
# module of this session imported triton earlier, the comparison reruns in a fresh interpreter.
PREIMPORTED = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from sglang_kvshare.kernels.kv_correct import kv_correct, kv_correct_reference, kv_correct_triton  # noqa: E402
from sglang_kvshare.lowrank import LowRank  # noqa: E402
from sglang_kvshare.rope import RopeSpec, inv_freq_for  # noqa: E402

ROWS, H, DH, T = 40, 2, 16, 7
in_process = pytest.mark.skipif(PREIMPORTED, reason="triton imported without the interpreter")


@pytest.mark.skipif(not PREIMPORTED, reason="already runs in process")
def test_in_fresh_interpreter():
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def _inputs(dtype, rotary_dim, is_neox, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(ROWS, H, DH, generator=g).to(dtype)
    v = torch.randn(ROWS, H, DH, generator=g).to(dtype)
    src = torch.tensor([1, 3, 4, 5, 9, 10, 11])
    dst = torch.tensor([20, 21, 22, 30, 31, 32, 39])
    pos = torch.tensor([5, 5, 5, -3, 1000, 77, 123456])
    spec = RopeSpec(inv_freq_for(rotary_dim, 10000.0), rotary_dim, is_neox)
    kd = LowRank(torch.randn(T, 3, generator=g), torch.randn(3, H * DH, generator=g))
    vd = LowRank(torch.randn(T, 37, generator=g), torch.randn(37, H * DH, generator=g))  # r > BLOCK_R
    return k, v, src, dst, pos, spec, kd, vd


@in_process
@pytest.mark.parametrize(
    "rotary_dim,is_neox,with_delta", [(16, True, True), (8, True, True), (16, False, True), (16, True, False)]
)
def test_triton_matches_reference_fp32(rotary_dim, is_neox, with_delta):
    k, v, src, dst, pos, spec, kd, vd = _inputs(torch.float32, rotary_dim, is_neox)
    kd, vd = (kd, vd) if with_delta else (None, None)
    delta_pos = torch.arange(T) * 11 + 100
    k_ref, v_ref = k.clone(), v.clone()
    kv_correct_reference(k_ref, v_ref, src, dst, pos, spec, kd, vd, delta_pos)
    kv_correct_triton(k, v, src, dst, pos, spec, kd, vd, delta_pos)
    torch.testing.assert_close(k, k_ref, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(v, v_ref, rtol=1e-5, atol=1e-4)
    # the destination rows really changed and the rest of the pool is untouched
    k0, _, *_ = _inputs(torch.float32, rotary_dim, is_neox)
    untouched = torch.ones(ROWS, dtype=torch.bool)
    untouched[dst] = False
    assert torch.equal(k[untouched], k0[untouched])
    assert (k[dst] - k0[dst]).abs().max() > 0.1


@in_process
def test_triton_matches_reference_bf16():
    k, v, src, dst, pos, spec, kd, vd = _inputs(torch.bfloat16, 16, True)
    k_ref, v_ref = k.clone(), v.clone()
    kv_correct_reference(k_ref, v_ref, src, dst, pos, spec, kd, vd, 3)
    kv_correct_triton(k, v, src, dst, pos, spec, kd, vd, 3)
    torch.testing.assert_close(k.float(), k_ref.float(), rtol=1e-2, atol=5e-2)
    torch.testing.assert_close(v.float(), v_ref.float(), rtol=1e-2, atol=5e-2)


@in_process
def test_reference_rotation_then_delta_semantics():
    """Rotation by 0 plus a delta equals gather + delta; the dispatcher uses the reference on CPU."""
    k, v, src, dst, _, spec, kd, vd = _inputs(torch.float32, 16, True)
    k0, v0 = k.clone(), v.clone()
    kv_correct(k, v, src, dst, 0, spec, kd, vd)
    expect_k = k0[src] + (kd.A @ kd.B).reshape(T, H, DH)
    expect_v = v0[src] + (vd.A @ vd.B).reshape(T, H, DH)
    torch.testing.assert_close(k[dst], expect_k)
    torch.testing.assert_close(v[dst], expect_v)


@in_process
def test_launcher_rejects_bad_shapes():
    k, v, src, dst, pos, spec, kd, vd = _inputs(torch.float32, 16, True)
    bad = LowRank(torch.randn(T, 3), torch.randn(3, H * DH + 1))
    with pytest.raises(AssertionError):
        kv_correct_triton(k, v, src, dst, pos, spec, bad, None)
    with pytest.raises(AssertionError):
        kv_correct_triton(k, v, src, dst[:-1], pos, spec)
