import pytest
import torch

from sglang_kvshare.lowrank import Dense, LowRank, effective_rank, factorize, randomized_svd, truncated_svd


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_full_rank_reconstructs_exactly_and_rank_is_clipped():
    Z = _randn(6, 10)
    f = truncated_svd(Z, rank=32)
    assert (f.rank, f.rows, f.cols) == (6, 6, 10)
    assert f.A.shape == (6, 6) and f.B.shape == (6, 10)
    torch.testing.assert_close(f.reconstruct(), Z, rtol=0, atol=1e-5)


def test_error_decreases_with_rank_as_eckart_young():
    Z = _randn(20, 12, seed=1)
    S = torch.linalg.svdvals(Z.double())
    errors = []
    for r in range(1, 13):
        err = torch.linalg.matrix_norm(truncated_svd(Z, r).reconstruct() - Z).item()
        assert err == pytest.approx(S[r:].square().sum().sqrt().item(), abs=1e-4)
        errors.append(err)
    assert all(a > b for a, b in zip(errors, errors[1:]))
    assert errors[-1] < 1e-4


def test_factors_are_u_sigma_and_orthonormal_rows():
    Z = _randn(9, 7, seed=2)
    f = truncated_svd(Z, 3)
    torch.testing.assert_close(f.B @ f.B.T, torch.eye(3), atol=1e-5, rtol=0)
    norms = f.A.norm(dim=0)
    torch.testing.assert_close(norms, torch.linalg.svdvals(Z)[:3], atol=1e-5, rtol=0)


def test_batched_layers_and_prefix_rows():
    Z = _randn(3, 10, 8, seed=3)
    f = truncated_svd(Z, 2)
    assert f.A.shape == (3, 10, 2) and f.B.shape == (3, 2, 8)
    for layer in range(3):
        one = truncated_svd(Z[layer], 2).reconstruct()
        torch.testing.assert_close(f[layer].reconstruct(), one, atol=1e-5, rtol=0)
        torch.testing.assert_close(f[layer].reconstruct(4), one[:4], atol=1e-5, rtol=0)


def test_byte_count_and_storage_dtype():
    Z = _randn(2, 50, 16, seed=4)
    f32 = truncated_svd(Z, 4)
    assert f32.nbytes == 4 * 2 * (50 * 4 + 4 * 16)
    bf16 = truncated_svd(Z, 4, dtype=torch.bfloat16)
    assert bf16.A.dtype == torch.bfloat16 and bf16.B.dtype == torch.float32  # B stays orthonormal
    assert bf16.nbytes == f32.nbytes - bf16.A.numel() * 2
    dense = factorize(Z, None)
    assert isinstance(dense, Dense) and dense.nbytes == 4 * 2 * 50 * 16
    assert isinstance(factorize(Z, 4), LowRank)
    Z.add_(1.0)  # factors are copies, not views
    torch.testing.assert_close(dense.reconstruct(), Z - 1.0)


def test_effective_rank_energy():
    U, _ = torch.linalg.qr(_randn(30, 4, seed=5))
    V, _ = torch.linalg.qr(_randn(20, 4, seed=6))
    Z = U @ torch.diag(torch.tensor([3.0, 2.0, 1.0, 0.1])) @ V.T  # energies 9, 4, 1, 0.01
    assert effective_rank(Z, 0.9) == 2  # 13 / 14.01 = 0.928
    assert effective_rank(Z, 0.95) == 3  # 14 / 14.01
    assert effective_rank(Z, 1.0) == 4
    assert effective_rank(torch.zeros(5, 5)) == 0
    batched = effective_rank(torch.stack([Z, Z[:, :1] @ torch.ones(1, 20)]), 0.9)
    assert batched.tolist() == [2, 1]


def test_low_rank_rejects_mismatched_factors():
    with pytest.raises(ValueError):
        LowRank(torch.zeros(4, 3), torch.zeros(2, 5))


def test_factorize_keeps_short_matrices_dense_when_factors_would_be_larger():
    import torch

    from sglang_kvshare.lowrank import Dense, LowRank, factorize

    short = torch.randn(3, 10, 192)  # 32 * (10 + 192) > 10 * 192
    long = torch.randn(3, 200, 192)
    assert isinstance(factorize(short, 32), Dense)
    assert torch.equal(factorize(short, 32).reconstruct(), short)
    f = factorize(long, 32)
    assert isinstance(f, LowRank) and f.nbytes < long.numel() * long.element_size()


def test_randomized_svd_is_near_optimal_repeatable_and_leaves_the_global_generator_alone():
    g = torch.Generator().manual_seed(7)
    Z = (torch.randn(3, 400, 48, generator=g) * torch.logspace(0, -2, 48)) @ torch.linalg.qr(
        torch.randn(3, 48, 48, generator=g)
    ).Q
    exact = truncated_svd(Z, 6)
    state = torch.random.get_rng_state()
    fast = randomized_svd(Z, 6)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert torch.equal(randomized_svd(Z, 6).A, fast.A)

    def err(f):
        return float((f.reconstruct() - Z).norm() / Z.norm())

    assert fast.rank == 6 and err(fast) < 1.02 * err(exact)
    torch.testing.assert_close(
        randomized_svd(Z, 44).reconstruct(), truncated_svd(Z, 44).reconstruct()
    )  # exact near full rank
