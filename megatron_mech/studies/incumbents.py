"""The instability alarms users already have, as plain functions over a run's per-step series.

Each rule takes the values a trainer logs (``values[i]`` belongs to ``steps[i]``; without ``steps`` the values are
steps 1, 2, …) and returns the first step at which it fires, or None. They are written here from the rules'
published sources (cited per function), so the early-warning benchmark can score the monitors against them on the
same runs:

* :func:`megatron_spiky_loss_step` — Megatron-LM's "Spiky loss" check (``--check-for-spiky-loss``);
* :func:`olmo_spike_step` — OLMo-core's loss / grad-norm spike detection (``StabilityMonitorCallback``);
* :func:`qk_clip_step` — the maximum attention logit against the QK-clip threshold (Megatron-LM, MuonClip);
* :func:`threshold_step` — a plain level on a series (e.g. the grad norm), the level set by the user.

:func:`incumbent_firings` applies them all to one run's records, as the early-warning benchmark, the router-collapse
benchmark and the demo score them.
"""
from __future__ import annotations

import math
from collections import deque
from typing import Iterable, Mapping, Optional, Sequence

from megatron_mech.logit_symptom import MAX_LOGIT_METRIC

__all__ = ["GRAD_NORM_LEVEL", "GRAD_NORM_METRIC", "MEGATRON_SPIKY_LOSS_FACTOR", "MEGATRON_SPIKY_LOSS_SAMPLES",
           "OLMO_SPIKE_STD", "OLMO_SPIKE_WINDOW", "QK_CLIP_THRESHOLD", "incumbent_firings", "megatron_spiky_loss_step",
           "metric_series", "microbatches_per_rank", "olmo_spike_step", "qk_clip_step", "run_incumbent_firings",
           "threshold_step"]

MEGATRON_SPIKY_LOSS_FACTOR = 10.0  # pretrain_gpt.py: SPIKY_LOSS_FACTOR = 10
MEGATRON_SPIKY_LOSS_SAMPLES = 100  # RerunStateMachine.is_unexpectedly_large(num_samples=100)
OLMO_SPIKE_WINDOW = 128  # StabilityMonitorCallback.window_size
OLMO_SPIKE_STD = 6.0  # StabilityMonitorCallback.threshold_std
QK_CLIP_THRESHOLD = 100.0  # TransformerConfig.qk_clip_threshold; MuonClip's τ = 100
# The grad-norm alarm level, fixed on tuning seed 11 of the early-warning benchmark: the lowest round level the healthy
# tuning twin never exceeded (its largest grad norm: 19.1, one spike at step 45; median 0.68), a plain alarm set to
# stay quiet on a healthy run.
GRAD_NORM_LEVEL = 20.0
GRAD_NORM_METRIC = "symptom/grad_norm"


def _steps(values: Sequence[float], steps: Optional[Sequence[int]]) -> Sequence[int]:
    if steps is None:
        return range(1, len(values) + 1)
    if len(steps) != len(values):
        raise ValueError(f"steps ({len(steps)}) and values ({len(values)}) must have the same length")
    return steps


def megatron_spiky_loss_step(values: Sequence[float], steps: Optional[Sequence[int]] = None,
                             factor: float = MEGATRON_SPIKY_LOSS_FACTOR,
                             num_samples: int = MEGATRON_SPIKY_LOSS_SAMPLES) -> Optional[int]:
    """Megatron-LM's spiky-loss check: the first step whose loss is ``>= factor ×`` the largest ``|loss|`` of the
    first ``num_samples`` finite samples.

    Source: ``megatron/core/rerun_state_machine.py``, ``RerunStateMachine.is_unexpectedly_large`` (megatron-core
    0.16–0.19), called from ``loss_func`` in Megatron-LM's ``pretrain_gpt.py`` with ``threshold=SPIKY_LOSS_FACTOR``
    (10), ``context="loss"``: the value is ``|loss|``; NaN and ±inf are ignored (returned as not large, not counted —
    a separate, fatal check catches them); the first ``num_samples`` (100) counted values only raise the running
    maximum and never fire; from then on a value fires when ``value >= max × threshold``. The maximum is not
    updated after the first ``num_samples``.

    Megatron checks every micro-batch's local loss (in ``pretrain_gpt.py`` of Megatron-LM core_v0.19.0 the summed
    token loss of the micro-batch; with a fixed number of tokens per micro-batch the ratio test reads the same on
    the mean). From a per-step series each step is one sample, so a caller with ``k`` micro-batches per rank and
    step passes ``num_samples = ceil(100 / k)`` for the same stretch of run; a spike confined to one micro-batch
    is diluted in the step mean.
    """
    seen, largest = 0, 0.0
    for step, value in zip(_steps(values, steps), values):
        value = math.fabs(value)
        if math.isnan(value) or math.isinf(value):
            continue
        if seen < num_samples:
            seen += 1
            largest = max(largest, value)
            continue
        if value >= largest * factor:
            return int(step)
    return None


def olmo_spike_step(values: Sequence[float], steps: Optional[Sequence[int]] = None,
                    window: int = OLMO_SPIKE_WINDOW, threshold_std: float = OLMO_SPIKE_STD) -> Optional[int]:
    """OLMo-core's spike rule: the first value above ``mean + threshold_std × std`` of the ``window`` values
    before it.

    Source: allenai/OLMo-core, ``src/olmo_core/train/callbacks/stability_monitor.py``
    (``StabilityMonitorCallback._is_spike`` and ``pre_log_metrics``; defaults ``window_size=128``,
    ``threshold_std=6.0``), applied there to the train CE loss and to the total grad norm, each on its own
    history: a value is judged only once ``window`` earlier values are held (the current one is appended after
    the check, the oldest dropped); mean and standard deviation are the population ones over those values; a
    window with ``std < 1e-10`` never fires; the comparison is strict. A NaN never fires and, once in the window,
    keeps the mean NaN (so nothing fires while it is there) — as in the source.
    """
    history: deque = deque(maxlen=window)
    for step, value in zip(_steps(values, steps), values):
        if len(history) >= window:
            mean = sum(history) / len(history)
            std = math.sqrt(sum((x - mean) ** 2 for x in history) / len(history))
            if not std < 1e-10 and value > mean + threshold_std * std:
                return int(step)
        history.append(value)
    return None


def qk_clip_step(values: Sequence[float], steps: Optional[Sequence[int]] = None,
                 threshold: float = QK_CLIP_THRESHOLD) -> Optional[int]:
    """The first step whose maximum attention logit is above the QK-clip threshold.

    Source: megatron-core 0.19 ``megatron/core/transformer/attention.py`` (QK-clip rescales a head's query/key
    weights when ``max_attn_logits > qk_clip_threshold``; ``TransformerConfig.qk_clip_threshold`` defaults to 100)
    and ``megatron/training/training.py`` (``--log-max-attention-logit`` logs the model-wide maximum as
    ``max_attention_logit``); MuonClip (Kimi K2 technical report, arXiv:2507.20534) uses the same τ = 100. The
    comparison is strict, and a NaN never compares above it.
    """
    for step, value in zip(_steps(values, steps), values):
        if value > threshold:
            return int(step)
    return None


def threshold_step(values: Sequence[float], level: float, steps: Optional[Sequence[int]] = None) -> Optional[int]:
    """A plain alarm level: the first step whose value is above ``level`` or not finite (an alarm on a grad norm
    reads a NaN or inf as over any level)."""
    for step, value in zip(_steps(values, steps), values):
        if not math.isfinite(value) or value > level:
            return int(step)
    return None


def metric_series(records: Iterable[Mapping], metric: str) -> tuple:
    """``(steps, values)`` of one recorded metric in a run's ``mech.jsonl`` records (records without it skipped)."""
    pairs = [(int(r["step"]), float(r["metrics"][metric])) for r in records
             if isinstance((r.get("metrics") or {}).get(metric), (int, float))]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def microbatches_per_rank(flags: Sequence[str], nproc: int) -> int:
    """Micro-batches each rank runs per step: global batch / (micro batch × data-parallel size); the presets have
    no tensor or pipeline parallelism, so the data-parallel size is the process count."""
    value = {name: int(flags[flags.index(name) + 1]) for name in ("--global-batch-size", "--micro-batch-size")}
    return max(1, value["--global-batch-size"] // (value["--micro-batch-size"] * nproc))


def incumbent_firings(losses: Sequence[float], grad_norm: tuple, max_logit: tuple, *, microbatches: int,
                      grad_norm_level: float = GRAD_NORM_LEVEL) -> dict:
    """First firing step (or None) of each incumbent rule on one run, by rule name.

    ``losses``: the loss of every step from step 1; ``grad_norm`` and ``max_logit``: ``(steps, values)`` as
    recorded (:func:`metric_series`); ``microbatches``: micro-batches per rank and step (Megatron's check counts
    micro-batch samples)."""
    gn_steps, gn = grad_norm
    ml_steps, ml = max_logit
    interval = (gn_steps[1] - gn_steps[0]) if len(gn_steps) > 1 else 1
    return {
        "Megatron spiky loss": megatron_spiky_loss_step(
            losses, num_samples=math.ceil(MEGATRON_SPIKY_LOSS_SAMPLES / microbatches)),
        "OLMo loss spike": olmo_spike_step(losses),
        # OLMo-core judges every step's grad norm over 128 steps; the runs record it every `interval` steps, so the
        # window holds the records of the same 128 steps.
        "OLMo grad-norm spike": olmo_spike_step(gn, gn_steps, window=math.ceil(OLMO_SPIKE_WINDOW / interval)),
        f"max logit > {QK_CLIP_THRESHOLD:g} (QK-clip)": qk_clip_step(ml, ml_steps),
        f"grad norm > {grad_norm_level:g}": threshold_step(gn, grad_norm_level, gn_steps),
    }


def run_incumbent_firings(records: Iterable[Mapping], losses: Sequence[float], *, microbatches: int,
                          grad_norm_level: float = GRAD_NORM_LEVEL) -> dict:
    """:func:`incumbent_firings` of a run from its ``mech.jsonl`` records and per-step losses."""
    records = list(records)
    return incumbent_firings(losses, metric_series(records, GRAD_NORM_METRIC), metric_series(records, MAX_LOGIT_METRIC),
                             microbatches=microbatches, grad_norm_level=grad_norm_level)
