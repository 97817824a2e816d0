"""Per-module gradient signal-to-noise ratio (SNR) from squared gradient norms.

Framework-free: the two-batch estimator takes plain Python floats (a few scalars per module per step), the
reference estimator takes tensors. Nothing here talks to a process group; a distributed caller computes the
squared norms (local = small batch, DP-reduced = big batch) and passes the numbers in.

Definitions (per module m, summed over the module's coordinates)
---------------------------------------------------------------
* ``G = E[g]``, the true (population) mean gradient; ``‖G‖²`` is its squared norm.
* ``Σ``, the per-example gradient covariance; ``tr(Σ)`` is the total per-example variance.
* ``S = ‖G‖² / tr(Σ)`` — the SNR used by MoLS (``α_m = sqrt(S_base / S_m)``).

A batch of ``B`` independent examples has mean gradient ``G_B`` with ``E‖G_B‖² = ‖G‖² + tr(Σ)/B``.
Two batch sizes ``B_small < B_big`` give two equations and hence the unbiased per-step estimates

    ‖G‖²  ≈ (B_big·‖G_big‖² − B_small·‖G_small‖²) / (B_big − B_small)
    tr(Σ) ≈ (‖G_small‖² − ‖G_big‖²) / (1/B_small − 1/B_big)

Each is linear in the two squared norms, so it stays unbiased when ``‖G_small‖²`` is the *mean* of the squared
norms of several small batches (e.g. every DP rank's local gradient, or every micro-batch of a gradient
accumulation step), and when the small batch is a subset of the big one (only expectations are used).
The per-step estimates are very noisy; :class:`TwoBatchSNR` averages ``‖G‖²`` and ``tr(Σ)`` *separately* over a
window and only then divides (a ratio of averages, not an average of ratios, which would be biased and
dominated by steps whose ``tr(Σ)`` estimate is near zero).

What ``B`` counts
-----------------
``B`` is the number of independent samples averaged into the gradient: examples (sequences) or tokens. Either
unit works as long as it is used consistently for both batch sizes and for every module: ``tr(Σ)`` is then "per
example" or "per token" and every module's ``S`` is rescaled by the same factor, so ``α_m = sqrt(S_base/S_m)``,
which only depends on ratios of SNRs, does not change. (Tokens within a sequence are correlated, so "per-token"
``tr(Σ)`` is not a per-token variance in the i.i.d. sense; it is still a consistent scale.)

Edge-case decisions (documented on :class:`SNREstimate` too)
------------------------------------------------------------
* ``tr(Σ)`` window estimate ``≤ 0`` (possible by noise when the signal dominates): ``snr = inf`` — the noise is
  below what the window can resolve.
* ``‖G‖²`` window estimate ``< 0`` (possible by noise when the noise dominates) with ``tr(Σ) > 0``: ``snr = 0``
  (clamped; "no detectable signal"). ``grad_sq`` itself is reported unclamped so it stays unbiased.
* both ``≤ 0`` (e.g. a module that never received gradient): ``snr = nan`` — undetermined.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

__all__ = ["SNREstimate", "TwoBatchSNR", "sample_snr", "snr_ratio"]


@dataclass(frozen=True)
class SNREstimate:
    """Window estimate for one module.

    Attributes:
        grad_sq: unbiased estimate of ``‖G‖²`` (may be slightly negative by noise; not clamped).
        trace_cov: unbiased estimate of the per-example (per-unit-of-B) ``tr(Σ)`` (may be ``≤ 0`` by noise).
        snr: ``grad_sq / trace_cov`` with the rules of :func:`snr_ratio` (``inf`` if ``trace_cov ≤ 0``,
            ``0`` if ``grad_sq < 0``, ``nan`` if both are ``≤ 0``).
        steps: number of steps averaged (for :func:`sample_snr`: the number of gradient samples K).
    """

    grad_sq: float
    trace_cov: float
    snr: float
    steps: int


def snr_ratio(grad_sq: float, trace_cov: float) -> float:
    """``grad_sq / trace_cov`` with the documented noise rules (see the module docstring)."""
    if trace_cov <= 0.0:
        return math.nan if grad_sq <= 0.0 else math.inf
    return max(grad_sq, 0.0) / trace_cov


def _check_batches(small_batch: float, big_batch: float) -> tuple[float, float]:
    bs, bb = float(small_batch), float(big_batch)
    if not (math.isfinite(bs) and math.isfinite(bb) and bb > bs > 0.0):
        raise ValueError(f"need big_batch > small_batch > 0 (finite), got small_batch={small_batch!r}, "
                         f"big_batch={big_batch!r}")
    return bs, bb


class TwoBatchSNR:
    """Accumulates two-batch SNR estimates per module over an estimation window.

    Usage, once per optimizer step inside the window::

        est.update(small_sq_norms={"qk": 1.3, ...}, big_sq_norms={"qk": 0.4, ...}, small_batch=8, big_batch=64)
        ...
        est.estimates()["qk"].snr

    ``small_sq_norms[m]`` is ``‖G_small‖²`` for module ``m`` — or the mean of several small-batch squared norms of
    the same size ``small_batch`` (still unbiased, and less noisy). ``big_sq_norms[m]`` is ``‖G_big‖²``. The two
    mappings must have the same keys. Batch sizes may change between steps (each step's estimate is unbiased on
    its own).

    Non-finite norms (an overflowed or NaN gradient): that module is skipped for that step only — its window
    sums are left untouched and the skip is counted in :attr:`skipped` / :attr:`skipped_by_module`, so one bad
    step cannot poison the window.
    """

    def __init__(self) -> None:
        # Per module: [sum of per-step ‖G‖² estimates, sum of per-step tr(Σ) estimates, accepted steps].
        self._sums: dict[str, list] = {}
        self._skipped: dict[str, int] = {}
        self._steps = 0

    # ------------------------------------------------------------------ accumulation
    def update(self, small_sq_norms: Mapping[str, float], big_sq_norms: Mapping[str, float],
               small_batch: float, big_batch: float) -> None:
        """Add one step. Validates everything before changing any state (a failed call changes nothing).

        Raises:
            ValueError: ``big_batch > small_batch > 0`` violated, the module sets of the two mappings differ, or a
                squared norm is negative (a caller's bug: it would bias the estimate silently).
        """
        bs, bb = _check_batches(small_batch, big_batch)
        small_keys, big_keys = set(small_sq_norms), set(big_sq_norms)
        if small_keys != big_keys:
            raise ValueError(f"small_sq_norms and big_sq_norms must name the same modules; only in small: "
                             f"{sorted(small_keys - big_keys)}, only in big: {sorted(big_keys - small_keys)}")
        inv_gap = 1.0 / (1.0 / bs - 1.0 / bb)
        # Convert everything first so a bad value (e.g. a string) raises before any state changes.
        pairs = [(name, float(small_sq_norms[name]), float(big_sq_norms[name])) for name in small_sq_norms]
        negative = [(name, s, b) for name, s, b in pairs if s < 0 or b < 0]  # NaN compares False: skipped below
        if negative:
            raise ValueError(f"squared norms must be >= 0, got {negative[0][1]} (small) / {negative[0][2]} (big) "
                             f"for module {negative[0][0]!r}")
        for name, s, b in pairs:
            if not (math.isfinite(s) and math.isfinite(b)):
                self._skipped[name] = self._skipped.get(name, 0) + 1
                continue
            acc = self._sums.setdefault(name, [0.0, 0.0, 0])
            acc[0] += (bb * b - bs * s) / (bb - bs)
            acc[1] += (s - b) * inv_gap
            acc[2] += 1
        self._steps += 1

    # ------------------------------------------------------------------ results
    def estimates(self) -> dict[str, SNREstimate]:
        """Window estimates for every module with at least one accepted step (modules whose every step was
        skipped are absent; see :attr:`skipped_by_module`)."""
        out = {}
        for name, (g_sum, t_sum, n) in self._sums.items():
            g, t = g_sum / n, t_sum / n
            out[name] = SNREstimate(grad_sq=g, trace_cov=t, snr=snr_ratio(g, t), steps=n)
        return out

    @property
    def modules(self) -> list[str]:
        """Modules with at least one accepted step, in first-seen order."""
        return list(self._sums)

    @property
    def steps(self) -> int:
        """Number of successful :meth:`update` calls in the window."""
        return self._steps

    @property
    def skipped(self) -> int:
        """Total number of (module, step) pairs skipped for non-finite norms."""
        return sum(self._skipped.values())

    @property
    def skipped_by_module(self) -> dict[str, int]:
        return dict(self._skipped)

    def reset(self) -> None:
        """Start a new window."""
        self._sums.clear()
        self._skipped.clear()
        self._steps = 0

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        """Plain Python types only (floats, ints, strs, dicts), so it fits any checkpoint format."""
        return {"version": 1, "steps": self._steps,
                "modules": {k: {"grad_sq_sum": v[0], "trace_cov_sum": v[1], "steps": v[2]}
                            for k, v in self._sums.items()},
                "skipped": dict(self._skipped)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("version") != 1:
            raise ValueError(f"unsupported TwoBatchSNR state version {state.get('version')!r}")
        self._sums = {str(k): [float(v["grad_sq_sum"]), float(v["trace_cov_sum"]), int(v["steps"])]
                      for k, v in state["modules"].items()}
        self._skipped = {str(k): int(v) for k, v in state["skipped"].items()}
        self._steps = int(state["steps"])


def sample_snr(grads: torch.Tensor | Sequence[torch.Tensor], batch_size: float = 1) -> SNREstimate:
    """Reference SNR from ``K`` independent gradient samples of one module.

    Args:
        grads: tensor ``[K, ...]`` or a sequence of ``K`` same-shape tensors; sample ``k`` is the mean gradient
            over ``batch_size`` independent examples (``batch_size=1``: per-example gradients).
        batch_size: examples (or tokens — the same unit as everywhere else) averaged into each sample.

    Returns ``SNREstimate(grad_sq, trace_cov, snr, steps=K)`` with, ``C`` the unbiased (``K − 1``) sample
    covariance of the samples and ``ḡ`` their mean (all in float64):

        grad_sq   = ‖ḡ‖² − tr(C)/K        (E‖ḡ‖² = ‖G‖² + tr(Σ)/(batch_size·K), and E tr(C) = tr(Σ)/batch_size)
        trace_cov = batch_size · tr(C)

    Raises:
        ValueError: fewer than 2 samples, mismatched shapes, ``batch_size ≤ 0`` or non-finite gradients.
    """
    if not isinstance(grads, torch.Tensor):
        grads = list(grads)
        if len(grads) < 2:
            raise ValueError(f"sample_snr needs K >= 2 gradient samples, got {len(grads)}")
        shapes = {tuple(g.shape) for g in grads}
        if len(shapes) != 1:
            raise ValueError(f"gradient samples must share one shape, got {sorted(shapes)}")
        grads = torch.stack([g.detach().to(torch.float64) for g in grads])
    if grads.dim() < 1 or grads.shape[0] < 2:
        raise ValueError(f"sample_snr needs K >= 2 gradient samples, got shape {tuple(grads.shape)}")
    bsz = float(batch_size)
    if not (math.isfinite(bsz) and bsz > 0):
        raise ValueError(f"batch_size must be finite and > 0, got {batch_size!r}")
    x = grads.detach().to(torch.float64).reshape(grads.shape[0], -1)
    if not bool(torch.isfinite(x).all()):
        raise ValueError("sample_snr got non-finite gradient values")
    k = x.shape[0]
    mean = x.mean(dim=0)
    tr_c = float(((x - mean) ** 2).sum()) / (k - 1)
    grad_sq = float(mean.dot(mean)) - tr_c / k
    trace_cov = bsz * tr_c
    return SNREstimate(grad_sq=grad_sq, trace_cov=trace_cov, snr=snr_ratio(grad_sq, trace_cov), steps=k)
