"""SLQ spectral entropy against the exact entropy of the SVD, on update-like spectra."""
import math

import pytest
import torch

from megatron_mech.core.slq import GRAM_KERNELS, gram_operator, gram_times, sharded_gram_matvec, \
    slq_spectral_entropy
from megatron_mech.core.spectral import matrix_spectrum, spectral_entropy


def update_like(m, n, decay, seed, rank=None):
    """A matrix with singular values σ_i = exp(-decay·i) (flat for decay 0), optionally of low rank."""
    g = torch.Generator().manual_seed(seed)
    k = min(m, n)
    u, _ = torch.linalg.qr(torch.randn(m, k, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(n, k, generator=g, dtype=torch.float64))
    s = torch.exp(-decay * torch.arange(k, dtype=torch.float64))
    if rank is not None:
        s[rank:] = 0
    return (u * s) @ v.T


@pytest.mark.parametrize("decay,rank", [(0.0, None), (0.02, None), (0.2, None), (0.0, 3)])
def test_slq_entropy_close_to_exact(decay, rank):
    m = update_like(300, 200, decay, seed=1, rank=rank)
    exact = spectral_entropy(matrix_spectrum(m)).item()
    est = slq_spectral_entropy(sharded_gram_matvec(m), 200, float(m.square().sum()), 200, steps=40, probes=16,
                               generator=torch.Generator().manual_seed(0))
    # Hutchinson error ~ sqrt(2·Σp²/probes)/log(n) on the normalized entropy; quadrature error is negligible at
    # k = 40 for these spectra. 0.03 is ≥ 4 standard errors for the flattest case here.
    assert abs(est - exact) < 0.03, (est, exact)


def test_slq_zero_matrix_is_nan():
    m = torch.zeros(10, 8, dtype=torch.float64)
    assert math.isnan(slq_spectral_entropy(sharded_gram_matvec(m), 8, 0.0, 8))


# ------------------------------------------------------------------------ block Krylov Rayleigh–Ritz route
def _krylov_case(kind: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    if kind == "collapsed":   # rank 3 + a little noise: the fault signature
        return (torch.randn(256, 3, dtype=torch.float64, generator=g) @ torch.randn(3, 512, dtype=torch.float64,
                                                                                   generator=g)
                + 1e-3 * torch.randn(256, 512, dtype=torch.float64, generator=g))
    u = torch.linalg.qr(torch.randn(256, 256, dtype=torch.float64, generator=g)).Q
    v = torch.linalg.qr(torch.randn(512, 256, dtype=torch.float64, generator=g)).Q
    return u @ torch.diag(torch.arange(1, 257, dtype=torch.float64) ** -1.0) @ v.T   # a decaying, update-like spectrum


@pytest.mark.parametrize("kind,tol", [("collapsed", 1e-7), ("decaying", 1e-3)])
def test_krylov_entropy_against_exact(kind, tol):
    from megatron_mech.core.slq import krylov_spectral_summaries

    m = _krylov_case(kind)
    calls = []

    def matvec(block):
        calls.append(block.shape)
        return m.T @ (m @ block)

    sv = matrix_spectrum(m)
    got = krylov_spectral_summaries(matvec, 512, float(m.square().sum()), 256, steps=20, block=8,
                                    generator=torch.Generator().manual_seed(1))
    assert abs(got["entropy"] - float(spectral_entropy(sv))) <= tol
    assert got["lambda_max"] == pytest.approx(float(sv[0]) ** 2, rel=1e-8)
    assert calls == [(512, 8)] * 20          # a fixed number of block products, whatever the values


@pytest.mark.parametrize("steps,block", [(3, 4), (2, 6), (8, 8)])
def test_krylov_is_exact_on_an_exactly_rank_deficient_matrix(steps, block):
    """An exactly rank-3 float64 matrix (no noise): once the basis holds G's range, the projections cancel the
    next directions to rounding noise, which the QR scales to unit length. Those must be made orthogonal to the
    basis too, or the Rayleigh–Ritz values are not the spectrum's (λ_max came out 3–58 % high); with them the
    route is exact to float64 rounding on every shape whose basis spans the range."""
    from megatron_mech.core.slq import krylov_spectral_summaries

    g = torch.Generator().manual_seed(0)
    m = torch.randn(96, 3, generator=g, dtype=torch.float64) @ torch.randn(3, 64, generator=g, dtype=torch.float64)
    sv = matrix_spectrum(m)
    got = krylov_spectral_summaries(lambda b: m.T @ (m @ b), 64, float(m.square().sum()), 64, steps=steps,
                                    block=block, generator=torch.Generator().manual_seed(1000))
    assert got["lambda_max"] == pytest.approx(float(sv[0]) ** 2, rel=1e-10)
    assert got["entropy"] == pytest.approx(float(spectral_entropy(sv)), abs=1e-10)


@pytest.mark.parametrize("n,block,rank", [(20, 8, None), (17, 8, None), (10, 3, None), (17, 8, 5)])
def test_krylov_is_exact_when_its_basis_fills_a_space_the_block_does_not_divide(n, block, rank):
    """A Gram of size n < steps·block with n not a multiple of ``block``: the last block has only
    n − (blocks before)·block directions left. Its other columns could not be orthogonal to the basis, and
    Rayleigh–Ritz on that basis gave entropies 0.07–0.23 off and λ_max 2–69 % high (the first three cases); with
    them zeroed the basis spans the whole space and the route is exact to float64 rounding — alone and in lock
    step with a matrix the block divides, and on a rank-5 matrix (cancelled directions before the last block)."""
    from megatron_mech.core.slq import krylov_spectral_summaries_many

    g = torch.Generator().manual_seed(0)
    first = (torch.randn(30, n, generator=g, dtype=torch.float64) if rank is None else
             torch.randn(30, rank, generator=g, dtype=torch.float64) @ torch.randn(rank, n, generator=g,
                                                                                   dtype=torch.float64))
    matrices = [first, torch.randn(30, 4 * block, generator=g, dtype=torch.float64)]
    for chosen in ([0], [0, 1]):
        got = krylov_spectral_summaries_many(
            [lambda b, m=matrices[i]: m.T @ (m @ b) for i in chosen], [matrices[i].shape[1] for i in chosen],
            [float(matrices[i].square().sum()) for i in chosen], [min(matrices[i].shape) for i in chosen],
            steps=30, block=block, generators=[torch.Generator().manual_seed(1) for _ in chosen])
        for i, result in zip(chosen, got):
            sv = matrix_spectrum(matrices[i])
            assert result["lambda_max"] == pytest.approx(float(sv[0]) ** 2, rel=1e-10)
            assert result["entropy"] == pytest.approx(float(spectral_entropy(sv)), abs=1e-10)


def test_krylov_zero_and_nonfinite_give_nan_with_the_same_products():
    from megatron_mech.core.slq import krylov_spectral_summaries

    for z in (0.0, math.nan):
        calls = []
        got = krylov_spectral_summaries(lambda b: calls.append(1) or torch.zeros_like(b), 64, z, 32, steps=5, block=4)
        assert math.isnan(got["entropy"]) and math.isnan(got["lambda_max"])
        assert len(calls) == 5


@pytest.mark.parametrize("shard_dim", [0, 1])
@pytest.mark.parametrize("columns", [None, 1, 8])
def test_gram_times_is_the_gram_product(shard_dim, columns):
    """``gram_times`` against the dense Gram formed first (float64 reference): xᵀx·v for a row split, x·xᵀ·v for a
    column split, for a vector and for blocks."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(37, 23, dtype=torch.float64, generator=gen)
    gram = x.T @ x if shard_dim == 0 else x @ x.T
    shape = (gram.shape[0],) if columns is None else (gram.shape[0], columns)
    v = torch.randn(shape, dtype=torch.float64, generator=gen)
    got = gram_times(x, v, shard_dim)
    assert got.shape == v.shape
    # different summation orders of the same float64 sums: relative error ~ n·eps
    torch.testing.assert_close(got, gram @ v, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kernel", GRAM_KERNELS)
@pytest.mark.parametrize("shard_dim", [0, 1])
@pytest.mark.parametrize("columns", [None, 1, 8])
def test_gram_operator_kernels_are_the_gram_product(kernel, shard_dim, columns):
    """Every kernel of ``gram_operator`` on a float32 CPU shard (oneDNN's inner product where this torch has it,
    which the CPU wheel the tests install does) against the float64 dense Gram: xᵀx·v, x·xᵀ·v, vector and
    blocks, shapes large enough that both kernels block their sums."""
    gen = torch.Generator().manual_seed(6)
    x64 = torch.randn(300, 517, dtype=torch.float64, generator=gen)
    x = x64.float()
    gram = x.double().T @ x.double() if shard_dim == 0 else x.double() @ x.double().T
    shape = (gram.shape[0],) if columns is None else (gram.shape[0], columns)
    v = torch.randn(shape, dtype=torch.float64, generator=gen).float()
    got = gram_operator(x, shard_dim, kernel)(v)
    assert got.shape == v.shape and got.dtype == torch.float32
    # float32 sums of ~500 terms, twice: relative error ~ sqrt(n)·eps32 per entry, 1e-5 of the largest is wide
    ref = gram @ v.double()
    assert float((got.double() - ref).abs().max()) <= 1e-5 * float(ref.abs().max())


def test_gram_operator_auto_uses_onednn_on_float32_cpu_and_matmul_elsewhere(monkeypatch):
    """``"auto"`` takes oneDNN's inner product for a float32 CPU shard (the skinny products' fast kernel) and
    torch.matmul for float64; ``"onednn"`` refuses what it cannot run; an unknown kernel is named."""
    import megatron_mech.core.slq as slq
    calls = []
    real = slq._onednn_linear_op()
    assert real is not None, "this torch (the tests' CPU wheel) has oneDNN's linear"
    monkeypatch.setattr(slq, "_onednn_linear_op", lambda: lambda *a: calls.append(1) or real(*a))
    v = torch.ones(20, 8)
    gram_operator(torch.ones(10, 20), 0)(v)
    assert len(calls) == 2                       # both products
    gram_operator(torch.ones(10, 20, dtype=torch.float64), 0)(v.double())
    assert len(calls) == 2
    with pytest.raises(ValueError, match="float32 CPU"):
        gram_operator(torch.ones(10, 20, dtype=torch.float64), 0, "onednn")
    with pytest.raises(ValueError, match="kernel"):
        gram_operator(torch.ones(10, 20), 0, "blas")


def test_onednn_check_holds_under_a_float64_default_dtype(monkeypatch):
    """The once-per-process check builds float32 CPU tensors itself: a process that set float64 as its default
    dtype before the first Krylov product still gets the oneDNN kernel (the check failing would silently leave
    every product on the slower kernel)."""
    import megatron_mech.core.slq as slq
    monkeypatch.setattr(slq, "_ONEDNN_LINEAR", None)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert slq._onednn_linear_op() is not None
    finally:
        torch.set_default_dtype(previous)
