"""Paired comparisons over seeds: the mean paired difference with a Student-t confidence interval.

Two arms run on the same seeds (same data order and initial weights per seed) give one difference per seed;
the interval is ``mean ± t_{(1+level)/2, n-1} · sd / sqrt(n)``. The t quantile is computed here (no SciPy
dependency) from the t density by Simpson integration and bisection; it matches the closed forms for 1 and 2
degrees of freedom and the usual tables to better than 1e-6.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Optional, Sequence

__all__ = ["PairedCI", "paired_ci", "t_quantile"]


def _t_density(x: float, df: int) -> float:
    c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    return math.exp(c - (df + 1) / 2 * math.log1p(x * x / df))


def _t_cdf(x: float, df: int, intervals: int = 4000) -> float:
    """P(T ≤ x) for x ≥ 0: 1/2 + ∫_0^x density (Simpson; the density is smooth and bounded)."""
    if x <= 0:
        return 0.5
    # integrate in u = atan(x) so the heavy tail of small df stays well resolved
    b = math.atan(x)
    h = b / intervals
    total = 0.0
    for i in range(intervals + 1):
        u = i * h
        w = 1 if i in (0, intervals) else (4 if i % 2 else 2)
        total += w * _t_density(math.tan(u), df) / math.cos(u) ** 2
    return 0.5 + total * h / 3


def t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile (0.5 < p < 1) of Student's t with ``df`` ≥ 1 degrees of freedom."""
    if not 0.5 < p < 1:
        raise ValueError(f"p must be in (0.5, 1), got {p!r}")
    if int(df) != df or df < 1:
        raise ValueError(f"df must be a whole number >= 1, got {df!r}")
    lo, hi = 0.0, 1.0
    while _t_cdf(hi, df) < p:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        if _t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


@dataclass(frozen=True)
class PairedCI:
    """A paired difference (arm − reference) over seeds.

    Attributes:
        n: number of paired seeds.
        mean: mean difference.
        sd: sample standard deviation of the differences (0 for n = 1).
        half_width: t_{(1+level)/2, n-1} · sd / sqrt(n); ``None`` for n = 1 (no interval).
        level: confidence level (0.95).
    """

    n: int
    mean: float
    sd: float
    half_width: Optional[float]
    level: float = 0.95

    @property
    def low(self) -> Optional[float]:
        return None if self.half_width is None else self.mean - self.half_width

    @property
    def high(self) -> Optional[float]:
        return None if self.half_width is None else self.mean + self.half_width

    @property
    def excludes_zero(self) -> Optional[bool]:
        """True when the interval lies entirely above or below zero; ``None`` without an interval."""
        return None if self.half_width is None else (self.low > 0 or self.high < 0)

    def text(self, digits: int = 4) -> str:
        if self.half_width is None:
            return f"{self.mean:+.{digits}f} (1 seed, no interval)"
        verdict = "excludes 0" if self.excludes_zero else "includes 0"
        return (f"{self.mean:+.{digits}f} [{self.low:+.{digits}f}, {self.high:+.{digits}f}] "
                f"({int(round(100 * self.level))}% CI, n={self.n}, {verdict})")


def paired_ci(diffs: Sequence[float], level: float = 0.95) -> PairedCI:
    """Mean of per-seed differences with its Student-t interval at ``level``."""
    diffs = [float(d) for d in diffs]
    if not diffs:
        raise ValueError("paired_ci needs at least one paired difference")
    if not all(math.isfinite(d) for d in diffs):
        raise ValueError(f"paired differences must be finite, got {diffs}")
    n = len(diffs)
    mean = statistics.fmean(diffs)
    if n == 1:
        return PairedCI(1, mean, 0.0, None, level)
    sd = statistics.stdev(diffs)
    return PairedCI(n, mean, sd, t_quantile((1 + level) / 2, n - 1) * sd / math.sqrt(n), level)
