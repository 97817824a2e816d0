"""Spectra of a matrix split across ranks (megatron_mech.core.sharded).

Single-process tests cover the no-torch.distributed path (the local Gram is the whole Gram) and the packing
helpers; ``workers/sharded_worker.py`` runs the real thing under torchrun with 2 and 4 gloo ranks.

Tolerance: the Gram route squares singular values, so we compare σ² with an absolute bound
10·(m + n)·eps64·σ_max² — Gram formation (≤ m·eps·‖M‖² per entry), a backward-stable symmetric
eigensolver (≤ c·n·eps·‖G‖₂) and the float64 SVD reference (≤ 2·eps·σ_max²). Large singular values thus agree
to ~1e-14 relative, and the tiny ones of a graded or rank-deficient spectrum to ~sqrt((m + n)·eps)·σ_max.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dist_utils import WORKERS, run_torchrun
from megatron_mech.core.sharded import (all_reduce_packed, bucket_plan, frobenius_from_shard_grams, gram_size,
                                   shard_gram, sharded_matrix_spectra, sharded_matrix_spectrum,
                                   spectrum_from_shard_grams, squared_norm)
from megatron_mech.core.spectral import matrix_spectrum

EPS64 = torch.finfo(torch.float64).eps
WORKER = WORKERS / "sharded_worker.py"


def assert_spectrum_close(got, want, m, n):
    assert got.shape == want.shape
    if want.numel():
        bound = 10 * (m + n) * EPS64 * float(want[0]) ** 2
        assert (got.square() - want.square()).abs().max() <= bound + 1e-300


@pytest.mark.parametrize("shard_dim", [0, 1])
@pytest.mark.parametrize("shape", [(17, 5), (5, 17), (8, 8)])
def test_single_process_equals_matrix_spectrum(shape, shard_dim):
    M = torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    got = sharded_matrix_spectrum(M, shard_dim)
    assert got.dtype == torch.float64 and got.shape == (min(shape),)
    assert_spectrum_close(got, matrix_spectrum(M), *shape)


@settings(max_examples=25, deadline=None)
@given(m=st.integers(1, 12), n=st.integers(1, 12), rank=st.integers(1, 12), shard_dim=st.sampled_from([0, 1]),
       seed=st.integers(0, 2**16))
def test_property_rank_deficient(m, n, rank, shard_dim, seed):
    gen = torch.Generator().manual_seed(seed)
    M = torch.randn(m, rank, generator=gen, dtype=torch.float64) @ torch.randn(rank, n, generator=gen,
                                                                                dtype=torch.float64)
    assert_spectrum_close(sharded_matrix_spectrum(M, shard_dim), matrix_spectrum(M), m, n)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("shard_dim", [0, 1])
def test_non_finite_gives_nan_not_exception(bad, shard_dim):
    M = torch.randn(6, 4, dtype=torch.float64)
    M[2, 1] = bad
    sv = sharded_matrix_spectrum(M, shard_dim)
    assert sv.shape == (4,) and torch.isnan(sv).all()
    packed = shard_gram(M, shard_dim)
    assert torch.isfinite(packed[:-1]).all() and packed[-1] == 1   # zeroed in the Gram, counted separately
    assert math.isnan(frobenius_from_shard_grams(packed, gram_size(M.shape, shard_dim)))


def test_float32_input_and_empty_slice():
    M = torch.randn(9, 4)
    assert_spectrum_close(sharded_matrix_spectrum(M, 0), matrix_spectrum(M.double()), 9, 4)
    assert sharded_matrix_spectrum(torch.zeros(0, 4), 0).shape == (0,)      # no rows anywhere: empty spectrum
    sv = sharded_matrix_spectrum(torch.zeros(0, 4), 1)                      # a 0×4 matrix's column Gram: 0×0
    assert sv.shape == (0,)


def test_packed_layout_and_frobenius():
    M = torch.randn(7, 3, dtype=torch.float64)
    packed = shard_gram(M, 0)
    assert packed.shape == (3 * 3 + 2,) and packed[9] == 7 and packed[10] == 0
    assert torch.allclose(packed[:9].view(3, 3), M.T @ M)
    assert math.isclose(frobenius_from_shard_grams(packed, 3), float(M.norm()), rel_tol=1e-13)
    packed1 = shard_gram(M, 1)
    assert packed1.shape == (7 * 7 + 2,) and packed1[49] == 3
    # Two "ranks" of a row split: summed packed contributions give the whole matrix's spectrum.
    a, b = M[:4], M[4:]
    summed = shard_gram(a, 0) + shard_gram(b, 0)
    assert_spectrum_close(spectrum_from_shard_grams(summed, 3), matrix_spectrum(M), 7, 3)
    with pytest.raises(ValueError, match="packed"):
        spectrum_from_shard_grams(summed[:-1], 3)


def test_batched_equals_individual_without_dist():
    gen = torch.Generator().manual_seed(3)
    mats = [torch.randn(5, 8, generator=gen, dtype=torch.float64), torch.randn(9, 2, generator=gen)]
    got = sharded_matrix_spectra(mats, [0, 1])
    for g, M, d in zip(got, mats, [0, 1]):
        assert torch.equal(g, sharded_matrix_spectrum(M, d))
    with pytest.raises(ValueError, match="shard_dim has 1 entries"):
        sharded_matrix_spectra(mats, [0])


def test_validation():
    M = torch.randn(3, 4)
    for bad_dim in (2, -1, True):
        with pytest.raises(ValueError, match="shard_dim"):
            sharded_matrix_spectrum(M, bad_dim)
    with pytest.raises(ValueError, match="2-D"):
        sharded_matrix_spectrum(torch.randn(3), 0)
    with pytest.raises(ValueError, match="accumulate_dtype"):
        sharded_matrix_spectrum(M, 0, accumulate_dtype=torch.int64)


def test_bucket_plan_and_no_dist_packing():
    assert bucket_plan([5, 3, 9, 1], None) == [[0, 1, 2, 3]]
    assert bucket_plan([5, 3, 9, 1], 8) == [[0, 1], [2], [3]]
    assert bucket_plan([], None) == []
    with pytest.raises(ValueError, match="bucket_elements"):
        bucket_plan([1], 0)
    ts = [torch.ones(3), torch.zeros(2)]
    out = all_reduce_packed(ts)
    assert all(a is b for a, b in zip(out, ts))   # nothing to reduce without torch.distributed


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize("nproc", [2, 4])
def test_sharded_spectra_under_torchrun_gloo(nproc):
    result = run_torchrun(WORKER, nproc=nproc, timeout=200)
    assert "SHARDED PASS" in result.stdout, result.stdout[-4000:]


@pytest.mark.parametrize("shard_dim", [0, 1])
def test_lower_only_gram_is_the_lower_triangle_by_blocks(shard_dim):
    """k = 1100 takes the blocked path (2 column blocks of uneven width): the packed Gram is the lower triangle
    of the full one (above the whole diagonal blocks exact zeros), and the spectrum, norm and non-finite count
    are those of the full route. float64: the blocks are the same dot products as the full GEMM's, to rounding
    (1e-12 relative)."""
    gen = torch.Generator().manual_seed(3)
    M = torch.randn(40, 1100, dtype=torch.float64, generator=gen)
    M = M if shard_dim == 0 else M.T.contiguous()          # Gram over the 1100-long side either way
    k = gram_size(M.shape, shard_dim)
    assert k == 1100
    full = shard_gram(M, shard_dim)
    lower = shard_gram(M, shard_dim, lower_only=True)
    g_full, g_lower = full[: k * k].view(k, k), lower[: k * k].view(k, k)
    upper = torch.ones(k, k, dtype=torch.bool).triu(1)
    formed = upper & (g_lower != 0)                         # inside the whole diagonal blocks only
    assert formed.any() and not formed[:550, 550:].any()   # the upper-right block is never formed
    torch.testing.assert_close(g_lower[formed], g_full[formed], rtol=1e-12, atol=1e-12 * float(g_full.abs().max()))
    torch.testing.assert_close(g_lower.tril(), g_full.tril(), rtol=1e-12, atol=1e-12 * float(g_full.abs().max()))
    assert torch.equal(lower[k * k:], full[k * k:])
    torch.testing.assert_close(spectrum_from_shard_grams(lower, k), spectrum_from_shard_grams(full, k),
                               rtol=0, atol=1e-10 * float(matrix_spectrum(M)[0]))
    assert math.isclose(frobenius_from_shard_grams(lower, k), frobenius_from_shard_grams(full, k), rel_tol=1e-12)
    M[3, 7] = math.nan
    bad = shard_gram(M, shard_dim, lower_only=True)
    assert bad[-1] == 1 and torch.isfinite(bad[:-1]).all()
    assert torch.isnan(spectrum_from_shard_grams(bad, k)).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("shape", [(7,), (3, 5), (300, 4000), (2, 3, 4)])
def test_squared_norm_is_the_float64_sum_of_squares(dtype, shape):
    """Blockwise float64 sum of squares against the float64 copy squared and summed at once (the reference);
    300 × 4000 spans several blocks. Non-finite entries give a non-finite result."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    got = squared_norm(x)
    assert got.dtype == torch.float64
    # the same float64 squares summed in another order: relative error ~ log(n)·eps
    assert float(got) == pytest.approx(float(x.double().square().sum()), rel=1e-12)
    x.view(-1)[len(x.view(-1)) // 2] = float("nan")
    assert not math.isfinite(float(squared_norm(x)))
