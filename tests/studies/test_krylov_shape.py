"""benchmarks/krylov_shape.py: the rule that picks a Krylov shape on the tuning seeds, and the accuracy table's
errors against an exact SVD on a small case."""
from __future__ import annotations

import torch

from benchmarks import krylov_shape


def _errors(by_shape: dict) -> dict:
    """One seed's errors: every spectrum gets the same ``{shape: (entropy error, λ_max error)}``."""
    return {"a": dict(by_shape), "b": dict(by_shape)}


def test_rule_picks_the_fewest_steps_within_the_slack_and_falls_back_to_the_current_shape():
    ok = {"30×8": (1e-3, 1e-15), "15×16": (1e-3 + 5e-5, 1e-9), "10×24": (1e-3 + 5e-5, 5e-7), "8×30": (2e-3, 0.0)}
    # 8 × 30 breaks the entropy slack; 10 × 24 is the fewest steps left within both limits
    assert krylov_shape.chosen([_errors(ok)]) == (10, 24)
    lambda_off = dict(ok, **{"10×24": (1e-3, 2e-6)})
    assert krylov_shape.chosen([_errors(ok), _errors(lambda_off)]) == (15, 16)   # every seed must pass
    nothing = {"30×8": (0.0, 0.0), "15×16": (1e-3, 0.0), "10×24": (1e-3, 0.0), "8×30": (1e-3, 0.0)}
    assert krylov_shape.chosen([_errors(nothing)]) == krylov_shape.CURRENT


def test_errors_are_measured_against_the_exact_spectrum(monkeypatch):
    # a rank-3 matrix: every candidate spans its range, so each entropy and λ_max is exact to rounding (the
    # flat remainder is zero); a 1/i spectrum: the remainder is an approximation, never exact
    g = torch.Generator().manual_seed(0)
    low = torch.randn(96, 3, generator=g, dtype=torch.float64) @ torch.randn(3, 64, generator=g, dtype=torch.float64)
    u = torch.linalg.qr(torch.randn(96, 64, generator=g, dtype=torch.float64)).Q
    decaying = u @ torch.diag(1 / torch.arange(1, 65, dtype=torch.float64))
    monkeypatch.setattr(krylov_shape, "spectra", lambda seed: {"rank 3": low, "1/i": decaying})
    monkeypatch.setattr(krylov_shape, "CANDIDATES", [(3, 4), (2, 6)])
    got = krylov_shape.errors(0)
    for shape in ("3×4", "2×6"):
        entropy, top = got["rank 3"][shape]
        assert entropy < 1e-10 and top < 1e-10   # float64 Rayleigh–Ritz on an exactly spanned range
        assert got["1/i"][shape][0] > 1e-6        # 12 of 64 directions: the remainder estimate is off
