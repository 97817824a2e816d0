"""Spectral math against independent references: closed forms, numpy's SVD, and dense d×d increments."""
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from megatron_mech.core.spectral import (
    _TERM_BLOCKS,
    effective_rank,
    matrix_spectrum,
    qk_increment_spectra,
    qk_increment_spectra_dense,
    spectral_entropy,
    spectrum_from_gram,
    stable_rank,
)


# --------------------------------------------------------------------------------------- scalar summaries
def direct_entropy(sv, power):
    p = np.asarray(sv, dtype=np.float64) ** power
    p = p / p.sum()
    nz = p[p > 0]
    return float(-(nz * np.log(nz)).sum())


@pytest.mark.parametrize("power", [1.0, 2.0, 3.0])
def test_entropy_matches_direct_formula(power):
    rng = np.random.default_rng(0)
    sv = rng.random((5, 7)) * 10
    sv[1, 3:] = 0.0  # exact zeros: 0·log 0 = 0
    got = spectral_entropy(torch.tensor(sv), power=power, normalized=False)
    want = [direct_entropy(row, power) for row in sv]
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-12)
    got_norm = spectral_entropy(torch.tensor(sv), power=power)
    np.testing.assert_allclose(got_norm.numpy(), np.array(want) / math.log(7), rtol=1e-12)
    np.testing.assert_allclose(effective_rank(torch.tensor(sv), power=power).numpy(), np.exp(want), rtol=1e-12)


def test_entropy_extremes_and_invalid_spectra():
    flat = torch.ones(3, 16)
    assert torch.allclose(spectral_entropy(flat), torch.ones(3, dtype=torch.float64))
    assert torch.allclose(effective_rank(flat), torch.full((3,), 16.0, dtype=torch.float64))
    one_mode = torch.zeros(16)
    one_mode[4] = 3.0
    assert spectral_entropy(one_mode).item() == 0.0
    assert effective_rank(one_mode).item() == pytest.approx(1.0)
    assert math.isnan(spectral_entropy(torch.zeros(8)).item())
    assert math.isnan(spectral_entropy(torch.tensor([1.0, math.nan, 2.0])).item())
    assert math.isnan(spectral_entropy(torch.tensor([1.0, math.inf, 2.0])).item())
    assert math.isnan(stable_rank(torch.zeros(4)).item())
    # one bad row does not poison the others
    batch = torch.stack([torch.ones(4), torch.zeros(4)])
    out = spectral_entropy(batch)
    assert out[0].item() == pytest.approx(1.0) and math.isnan(out[1].item())
    assert spectral_entropy(torch.tensor([5.0])).item() == 0.0  # n = 1: one mode, collapsed by definition


def test_stable_rank_definition():
    sv = torch.tensor([[3.0, 2.0, 1.0], [1.0, 1.0, 1.0]])
    assert torch.allclose(stable_rank(sv), torch.tensor([14.0 / 9.0, 3.0], dtype=torch.float64))


def test_entropy_bad_input():
    with pytest.raises(ValueError, match="non-negative"):
        spectral_entropy(torch.tensor([1.0, -0.5]))
    with pytest.raises(ValueError, match="scalar"):
        spectral_entropy(torch.tensor(1.0))
    with pytest.raises(ValueError, match="power"):
        spectral_entropy(torch.ones(3), power=0)


# --------------------------------------------------------------------------------------- one matrix
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_matrix_spectrum_matches_numpy(dtype):
    x = torch.randn(2, 30, 20, generator=torch.Generator().manual_seed(1)).to(dtype)
    want = np.linalg.svd(x.double().numpy(), compute_uv=False)
    got = matrix_spectrum(x)
    assert got.dtype == torch.float64 and got.shape == (2, 20)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    np.testing.assert_allclose(got.numpy(), want, atol=tol * want.max())


def test_matrix_spectrum_nonfinite_and_shapes():
    x = torch.randn(3, 5, 4)
    x[1, 2, 2] = math.nan
    sv = matrix_spectrum(x)
    assert torch.isnan(sv[1]).all() and torch.isfinite(sv[[0, 2]]).all()
    with pytest.raises(ValueError, match="at least 2 dimensions"):
        matrix_spectrum(torch.ones(5))


def test_spectrum_from_gram_matches_svd():
    m = torch.randn(40, 12, dtype=torch.float64)
    m[:, 6:] = m[:, :6] @ torch.randn(6, 6, dtype=torch.float64)  # rank 6: singular Gram
    got = spectrum_from_gram(m.T @ m)
    want = matrix_spectrum(m)
    assert torch.allclose(got, want, atol=1e-6 * want[0])  # σ from σ²: error ≤ sqrt(eps)·σ_max near zero
    assert torch.allclose(spectral_entropy(got), spectral_entropy(want), atol=1e-10)
    bad = torch.full((3, 3), math.nan)
    assert torch.isnan(spectrum_from_gram(bad)).all()
    with pytest.raises(ValueError, match="square"):
        spectrum_from_gram(torch.ones(3, 4))


# --------------------------------------------------------------------------------------- QK increments
def make_weights(num_heads, num_groups, d_model, d_head, scale, rel_step, dtype, seed, rank=None):
    g = torch.Generator().manual_seed(seed)
    wq = torch.randn(num_heads, d_model, d_head, generator=g, dtype=torch.float64) * scale
    wk = torch.randn(num_groups, d_model, d_head, generator=g, dtype=torch.float64) * scale

    def step(w):
        if rank is None:
            d = torch.randn(w.shape, generator=g, dtype=torch.float64)
        else:  # low-rank increment per head: a collapsed update direction
            u = torch.randn(w.shape[0], w.shape[1], rank, generator=g, dtype=torch.float64)
            v = torch.randn(w.shape[0], rank, w.shape[2], generator=g, dtype=torch.float64)
            d = u @ v
        return w + rel_step * scale * d

    wq2, wk2 = step(wq), step(wk)
    return [t.to(dtype) for t in (wq, wk, wq2, wk2)]


def factor_scales(wq_prev, wk_prev, wq, wk):
    """Per term, per head [H]: s = Σ_j ‖A_j‖_F·‖B_j‖_F, the scale ‖A‖_F·‖B‖_F of the balanced factors, over the
    block pairs (A_j, B_j) of the module's own term table (it only sets a tolerance: a wrong pair there is
    caught by the dense reference the spectra are compared with)."""
    h, g = wq.shape[0], wk.shape[0]
    group = torch.arange(h) // (h // g)
    q_prev, q_new, k_prev, k_new = (t.double() for t in (wq_prev, wq, wk_prev, wk))
    query = {"dq": q_new - q_prev, "q": q_prev}
    key = {"k": k_prev[group], "dk": (k_new - k_prev)[group], "k_new": k_new[group]}
    norm = lambda t: t.flatten(1).norm(dim=1)  # noqa: E731
    return {term: sum(norm(query[a]) * norm(key[b]) for a, b in pairs) for term, pairs in _TERM_BLOCKS.items()}


def assert_spectra_close(got, want, dtype, weights=None, method="gram"):
    """Singular values and entropies close to the dense reference, NaN where it is.

    Two error sources, each with its bound; a value passes within the larger one:
    * relative to the head's top singular value: ``rel`` (float64 1e-6: the Gram route resolves a value near
      zero only to ~sqrt(eps)·σ_max; float32 5e-3), entropies ``ent_tol`` (1e-5 / 1e-4);
    * relative to the factors' scale s = ‖A‖_F·‖B‖_F (``weights`` given): the Gram route's eigenvalues σ² carry
      an absolute error ~eps·s² (the Grams' rounding, balanced), so σ is resolved to ~sqrt(eps)·s whatever σ_top
      is — when the product cancels (s ≫ σ_top, e.g. Δ3 of two rank-1 increments whose d_head-sides are nearly
      orthogonal) that is far above rel·σ_top. The QR route's error is ~eps·s. p = σ²/Σσ² then moves by up
      to η = eps·s²/‖M‖_F², and −p·log p is continuous with modulus η(1 + |log η|), per value. Measured over
      3000 random cases of the strategy below: at most 0.77·sqrt(eps)·s (Gram), 3.8·eps·s (QR, float32) and
      0.44 of the entropy bound; the factor 4 is the margin.
    """
    rel, ent_tol = (5e-3, 1e-4) if dtype == torch.float32 else (1e-6, 1e-5)
    eps = torch.finfo(dtype).eps
    scales = factor_scales(*weights) if weights is not None else None
    for name, ref in want.items():
        x = getattr(got, name)
        assert x.shape == ref.shape and x.dtype == torch.float64
        nan_rows = torch.isnan(spectral_entropy(ref))
        assert torch.equal(torch.isnan(spectral_entropy(x)), nan_rows), name
        bound = rel * ref[:, 0]
        ent_bound = torch.full_like(bound, ent_tol)
        if scales is not None:
            s = scales[name]
            bound = torch.maximum(bound, 4 * (math.sqrt(eps) if method == "gram" else eps) * s)
            eta = (eps * s.square() / ref.square().sum(1).clamp_min(1e-300)).clamp(1e-300, math.exp(-1))
            n = ref.shape[1]
            ent_bound = torch.maximum(ent_bound, 4 * n * eta * (1 + eta.log().abs()) / math.log(n))
        err = ((x - ref).abs().amax(1) / bound.clamp_min(1e-300))[~nan_rows]
        assert err.numel() == 0 or err.max() <= 1, (name, err.max().item())
        ent_err = ((spectral_entropy(x) - spectral_entropy(ref)).abs() / ent_bound)[~nan_rows]
        assert ent_err.numel() == 0 or ent_err.max() <= 1, (name, ent_err.max().item())


qk_shapes = st.tuples(
    st.sampled_from([(1, 1), (2, 1), (4, 2), (4, 4), (6, 3)]),   # (H, G)
    st.integers(4, 48),                                         # d_model (may be < 2·d_head)
    st.sampled_from([2, 4, 8, 16]),                             # d_head
)


# An ill-conditioned W_q (condition 3.6e3) with d_model < 2·d_head in float32: the Schur-complement factor of
# the rank-deficient Gram left its top singular values 1 % off until such heads took the eigendecomposition.
@example(shape=((6, 3), 4, 4), log_scale=2.1875, log_step=0.0, dtype=torch.float32, method="gram", rank=None,
         seed=4)
@example(shape=((6, 3), 4, 4), log_scale=0.0, log_step=0.0, dtype=torch.float32, method="gram", rank=None,
         seed=4)
# Δ3 of rank-1 increments whose d_head-sides nearly cancel: σ_top is 1/1600 of the factors' scale.
@example(shape=((4, 2), 5, 4), log_scale=0.0, log_step=0.0, dtype=torch.float32, method="gram", rank=1,
         seed=1374)
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shape=qk_shapes, log_scale=st.floats(-6, 4), log_step=st.floats(-6, 0),
       dtype=st.sampled_from([torch.float32, torch.float64]), method=st.sampled_from(["gram", "qr"]),
       rank=st.sampled_from([None, None, 1, 2]), seed=st.integers(0, 2**16))
def test_compressed_matches_dense(shape, log_scale, log_step, dtype, method, rank, seed):
    (h, g), d_model, d_head = shape
    w = make_weights(h, g, d_model, d_head, 10.0 ** log_scale, 10.0 ** log_step, dtype, seed, rank)
    got = qk_increment_spectra(*w, method=method)
    want = qk_increment_spectra_dense(*w)
    assert_spectra_close(got, dict(want.items()), dtype, weights=w, method=method)


@pytest.mark.parametrize("method", ["gram", "qr"])
def test_zero_and_one_sided_increments(method):
    wq, wk, _, wk2 = make_weights(4, 2, 32, 8, 1.0, 1e-2, torch.float64, seed=3)
    zero = qk_increment_spectra(wq, wk, wq, wk, method=method)
    for name, sv in zero.items():
        assert torch.equal(sv, torch.zeros_like(sv)), name
        assert torch.isnan(spectral_entropy(sv)).all()
    # only W_k moves: Δ3 = 0, Δ1 = Δ2 = W_q ΔW_kᵀ (rank ≤ d_head)
    one_sided = qk_increment_spectra(wq, wk, wq, wk2, method=method)
    assert torch.equal(one_sided.delta3, torch.zeros_like(one_sided.delta3))
    assert_spectra_close(one_sided, dict(qk_increment_spectra_dense(wq, wk, wq, wk2).items()), torch.float64)
    assert torch.allclose(one_sided.delta1, one_sided.delta2, atol=1e-12 * one_sided.delta2.max())


def test_identity_delta1_equals_delta2_plus_delta3_densely():
    wq, wk, wq2, wk2 = make_weights(3, 3, 20, 5, 1.0, 0.3, torch.float64, seed=4)
    dq, dk = wq2 - wq, wk2 - wk
    delta1 = wq2 @ wk2.transpose(1, 2) - wq @ wk.transpose(1, 2)
    delta2 = dq @ wk.transpose(1, 2) + wq @ dk.transpose(1, 2)  # previous weights W in the first-order term
    delta3 = dq @ dk.transpose(1, 2)
    assert torch.allclose(delta1, delta2 + delta3, atol=1e-12)
    # … and the compressed spectra are those of exactly these matrices
    got = qk_increment_spectra(wq, wk, wq2, wk2)
    for name, dense in (("delta1", delta1), ("delta2", delta2), ("delta3", delta3)):
        want = np.linalg.svd(dense.numpy(), compute_uv=False)[:, : getattr(got, name).shape[1]]
        np.testing.assert_allclose(getattr(got, name).numpy(), want, atol=1e-10 * want.max())


def test_gqa_pairs_each_query_head_with_its_group():
    wq, wk, wq2, wk2 = make_weights(6, 2, 24, 4, 1.0, 0.1, torch.float64, seed=5)
    got = qk_increment_spectra(wq, wk, wq2, wk2, terms=("delta2",))
    for h in range(6):
        grp = h // 3  # H/G = 3 query heads per group
        dense = (wq2[h] - wq[h]) @ wk[grp].T + wq[h] @ (wk2[grp] - wk[grp]).T
        want = np.linalg.svd(dense.numpy(), compute_uv=False)[:8]
        np.testing.assert_allclose(got.delta2[h].numpy(), want, atol=1e-10 * want.max())


def test_terms_selects_what_is_computed():
    w = make_weights(2, 1, 16, 4, 1.0, 0.1, torch.float32, seed=6)
    only = qk_increment_spectra(*w, terms=("delta2",))
    assert only.delta1 is None and only.delta3 is None and only.delta2.shape == (2, 8)
    full = qk_increment_spectra(*w)
    assert torch.equal(only.delta2, full.delta2)
    assert full.delta3.shape == (2, 4)


def test_nonfinite_head_gives_nan_and_spares_the_others():
    wq, wk, wq2, wk2 = make_weights(4, 2, 16, 4, 1.0, 0.1, torch.float32, seed=7)
    clean = qk_increment_spectra(wq, wk, wq2, wk2)
    wq2_bad = wq2.clone()
    wq2_bad[1, 0, 0] = math.nan
    wk2_bad = wk2.clone()
    wk2_bad[1, 3, 1] = math.inf  # group 1 → heads 2, 3
    for method in ("gram", "qr"):
        bad = qk_increment_spectra(wq, wk, wq2_bad, wk2_bad, method=method)
        for name, sv in bad.items():
            assert torch.isnan(sv[1:]).all(), name
            assert torch.allclose(sv[0], getattr(clean, name)[0], rtol=1e-4, atol=1e-6), name


def test_bad_shapes_raise_clear_errors():
    wq, wk, wq2, wk2 = make_weights(4, 2, 16, 4, 1.0, 0.1, torch.float32, seed=8)
    with pytest.raises(ValueError, match="not divisible"):
        qk_increment_spectra(wq[:3], wk, wq2[:3], wk2)
    with pytest.raises(ValueError, match="differ in shape"):
        qk_increment_spectra(wq, wk, wq2[:, :8], wk2)
    with pytest.raises(ValueError, match="3-D"):
        qk_increment_spectra(wq[0], wk, wq2, wk2)
    with pytest.raises(ValueError, match="must be \\[G"):
        qk_increment_spectra(wq, wk[:, :, :2], wq2, wk2[:, :, :2])
    with pytest.raises(ValueError, match="terms"):
        qk_increment_spectra(wq, wk, wq2, wk2, terms=("delta4",))
    with pytest.raises(ValueError, match="method"):
        qk_increment_spectra(wq, wk, wq2, wk2, method="svd")


def test_gram_dtype_float64_on_float32_weights_is_exact_and_bad_values_raise():
    """gram_dtype=float64 gives float32 weights the float64 route's accuracy (the default float32 Grams are
    checked at their own tolerance in test_compressed_matches_dense); bad dtypes name the argument."""
    w = make_weights(4, 2, 32, 8, 1.0, 1e-3, torch.float32, seed=5, rank=1)
    got = qk_increment_spectra(*w, gram_dtype=torch.float64)
    assert_spectra_close(got, dict(qk_increment_spectra_dense(*w).items()), torch.float64)
    with pytest.raises(ValueError, match="gram_dtype"):
        qk_increment_spectra(*w, gram_dtype=torch.float16)
    with pytest.raises(ValueError, match="gram_dtype"):
        qk_increment_spectra(*w, method="qr", gram_dtype=torch.float64)
    with pytest.raises(ValueError, match="eig_dtype"):
        spectrum_from_gram(torch.eye(3), eig_dtype=torch.float16)


# ---------------------------------------------------------------------------------------------------------
# Extreme and non-finite input: one policy, never an exception from LAPACK
# ---------------------------------------------------------------------------------------------------------
from megatron_mech.core import spectral as S  # noqa: E402


def test_spectral_entropy_non_finite_policy():
    """NaN, +inf and -inf all give NaN (a flagged metric); a finite negative value is the caller's error."""
    for bad in (math.nan, math.inf, -math.inf):
        assert math.isnan(float(S.spectral_entropy(torch.tensor([1.0, bad]))))
    assert math.isnan(float(S.spectral_entropy(torch.zeros(3))))  # a zero increment (frozen layer)
    with pytest.raises(ValueError, match="non-negative"):
        S.spectral_entropy(torch.tensor([1.0, -0.5]))
    with pytest.raises(ValueError, match="real"):
        S.matrix_spectrum(torch.ones(3, 2, dtype=torch.complex64))


def test_spectral_entropy_is_scale_free_up_to_float64_range():
    sv = torch.tensor([3.0, 2.0, 1.0, 0.5], dtype=torch.float64)
    ref = float(S.spectral_entropy(sv))
    for scale in (1e-150, 1e150, 1e300):  # σ² would under/overflow without the max-normalisation
        assert float(S.spectral_entropy(sv * scale)) == pytest.approx(ref, rel=1e-12)


@pytest.mark.parametrize("scale", [1e100, 1e200, 1e300])
def test_huge_finite_weights_never_raise(scale):
    """Entries near 1e200 made eigh raise LinAlgError; every route now returns numbers or NaN."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(16, 8, generator=gen, dtype=torch.float64) * scale
    assert torch.allclose(S.matrix_spectrum(x) / scale, S.matrix_spectrum(x / scale), rtol=1e-10)
    S.spectrum_from_gram(x.T @ x)  # the Gram overflows to inf at 1e200: NaN, no exception
    wq = torch.randn(4, 32, 8, generator=gen, dtype=torch.float64) * scale
    wk = torch.randn(2, 32, 8, generator=gen, dtype=torch.float64) * scale
    for method in ("gram", "qr"):
        out = S.qk_increment_spectra(wq, wk, wq * 1.01, wk * 0.99, method=method)
        assert out.delta2.shape == (4, 16)


def test_guard_keeps_good_batch_elements_when_lapack_fails_on_one():
    """A batch where eigvalsh fails as a whole: the good element is still exact (vs a lone call), the
    ill-scaled one is retried rescaled (eigenvalues scale linearly)."""
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(8, 8, generator=gen, dtype=torch.float64)
    good = a @ a.T
    calls = []

    def flaky(m):
        calls.append(m.shape)
        if m.dim() == 3 or float(m.abs().amax()) > 1e6:  # the batch and the unscaled element fail
            raise torch.linalg.LinAlgError("did not converge")
        return torch.linalg.eigvalsh(m)

    out = S.guarded_linalg(flaky, torch.stack([good, good * 1e10]))
    ref = torch.linalg.eigvalsh(good)
    assert torch.allclose(out[0], ref, rtol=1e-12, atol=0)
    assert torch.allclose(out[1], ref * 1e10, rtol=1e-10, atol=0)

    def hopeless(m):  # fails on everything but the identity-shaped probe of the NaN fallback
        if m.dim() == 3 or not torch.equal(m, torch.eye(8, dtype=m.dtype)):
            raise torch.linalg.LinAlgError("did not converge")
        return torch.linalg.eigvalsh(m)

    nan_out = S.guarded_linalg(hopeless, torch.stack([good]))
    assert nan_out.shape == (1, 8) and bool(nan_out.isnan().all())


def test_qk_terms_as_one_string_and_complex_weights():
    gen = torch.Generator().manual_seed(3)
    w = [torch.randn(2, 16, 4, generator=gen, dtype=torch.float64) for _ in range(4)]
    one = S.qk_increment_spectra(*w, terms="delta2")  # used to be split into 'd', 'e', 'l', ...
    assert one.delta2 is not None and one.delta1 is None and one.delta3 is None
    assert torch.equal(one.delta2, S.qk_increment_spectra(*w, terms=("delta2",)).delta2)
    with pytest.raises(ValueError, match="wq must be real"):
        S.qk_increment_spectra(w[0], w[1], w[2].to(torch.complex128), w[3])


def test_singular_psd_factor_reproduces_rank_deficient_grams_in_every_branch():
    """F Fᵀ = G for the Grams Cholesky rejects: increment block first ([Δ, W] with a rank-2 Δ), increment block
    second ([W, Δ]), an all-zero padded half (Δ3), and both halves rank-deficient (the whole-Gram fallback)."""
    from megatron_mech.core.spectral import _singular_psd_factor

    g = torch.Generator().manual_seed(3)
    d_model, half = 64, 8
    w = torch.randn(d_model, half, generator=g, dtype=torch.float64)
    delta = 1e-3 * torch.randn(d_model, 2, generator=g, dtype=torch.float64) @ \
        torch.randn(2, half, generator=g, dtype=torch.float64)
    low = torch.randn(d_model, 3, generator=g, dtype=torch.float64) @ torch.randn(3, half, generator=g,
                                                                                   dtype=torch.float64)
    factors = [torch.cat([delta, w], 1), torch.cat([w, delta], 1), torch.cat([w, torch.zeros_like(w)], 1),
               torch.cat([low, low @ torch.randn(half, half, generator=g, dtype=torch.float64)], 1)]
    grams = torch.stack([x.T @ x for x in factors])
    assert (torch.linalg.cholesky_ex(grams).info != 0).all()
    f = _singular_psd_factor(grams)
    scale = grams.diagonal(dim1=1, dim2=2).amax(-1)[:, None, None]
    assert ((f @ f.transpose(1, 2) - grams).abs() / scale).max() < 1e-12


def test_singular_psd_factor_stays_backward_stable_with_an_ill_conditioned_weight_block():
    """[Δ, W] with d_model = d_head and W of condition 1e3 in float32: the Gram is rank-deficient (rank 4 of 8)
    and the Schur complement of W's block amplifies the Gram's rounding by cond(W)² = 1e6 — the factor must
    still reproduce the Gram to its own rounding level (r·eps32 relative), not to the amplified one."""
    from megatron_mech.core.spectral import _singular_psd_factor

    g = torch.Generator().manual_seed(5)
    q1, _ = torch.linalg.qr(torch.randn(4, 4, generator=g, dtype=torch.float64))
    q2, _ = torch.linalg.qr(torch.randn(4, 4, generator=g, dtype=torch.float64))
    w = q1 @ torch.diag(torch.tensor([1.0, 0.5, 0.2, 1e-3], dtype=torch.float64)) @ q2.T
    grams = []
    for seed in range(8):
        delta = torch.randn(4, 4, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        x = torch.cat([delta, w], 1).float()
        grams.append(x.T @ x)
    grams = torch.stack(grams)
    assert (torch.linalg.cholesky_ex(grams).info != 0).all()
    f = _singular_psd_factor(grams)
    scale = grams.diagonal(dim1=1, dim2=2).amax(-1)[:, None, None]
    assert ((f @ f.transpose(1, 2) - grams).abs() / scale).max() < 8 * 8 * torch.finfo(torch.float32).eps
