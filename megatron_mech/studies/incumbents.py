"""The instability alarms users already have, as plain functions over a run's per-step series.

Each rule takes the values a trainer logs (``values[i]`` belongs to ``steps[i]``; without ``steps`` the values are
steps 1, 2, …) and returns the first step at which it fires, or None; with ``from_step``, the first step at or after it
(the rule runs over the whole series as a trainer would, its alarms before ``from_step`` only are not returned:
a fault study asks which alarm fired first once the fault was on, an alarm before it also fires on the clean run).
They are written here from the rules' published sources (cited per function), so the early-warning benchmark can
score the monitors against them on the same runs:

* :func:`megatron_spiky_loss_step` — Megatron-LM's "Spiky loss" check (``--check-for-spiky-loss``);
* :func:`olmo_spike_step` — OLMo-core's loss / grad-norm spike detection (``StabilityMonitorCallback``);
* :func:`zclip_spike_step` — ZClip's z-score spike test on the grad norm (EMA of mean and variance);
* :func:`foundry_loss_spike_step` — llm-foundry's ``KillLossSpike`` callback (loss outliers against a running mean,
  and persistently high losses against a cap);
* :func:`qk_clip_step` — the maximum attention logit against the QK-clip threshold (Megatron-LM, MuonClip);
* :func:`threshold_step` — a plain level on a series (e.g. the grad norm), the level set by the user.

:func:`incumbent_firings` applies them all to one run's records, as the early-warning benchmark, the router-collapse
benchmark and the demo score them.
"""
from __future__ import annotations

import math
from collections import deque
from typing import Callable, Iterable, Mapping, Optional, Sequence

from megatron_mech.monitors.max_logit import MAX_LOGIT_METRIC

__all__ = ["FOUNDRY_LOSS_CAP", "FOUNDRY_MIN_WINDOW", "FOUNDRY_OUTLIER_MULTIPLIER", "FOUNDRY_PATIENCE",
           "FOUNDRY_WINDOW_FRACTION", "GRAD_NORM_LEVEL", "GRAD_NORM_METRIC", "MEGATRON_SPIKY_LOSS_FACTOR",
           "MEGATRON_SPIKY_LOSS_SAMPLES", "OLMO_SPIKE_STD", "OLMO_SPIKE_WINDOW", "QK_CLIP_THRESHOLD", "ZCLIP_ALPHA",
           "ZCLIP_EPS", "ZCLIP_WARMUP_STEPS", "ZCLIP_Z_THRESHOLD", "firing_steps", "foundry_loss_spike_step",
           "grad_norm_reading", "grad_norm_series", "incumbent_firings", "megatron_spiky_loss_step", "metric_series",
           "microbatches_per_rank", "olmo_spike_step", "qk_clip_step", "run_incumbent_firings", "step_grad_norms",
           "threshold_step", "zclip_spike_step"]

MEGATRON_SPIKY_LOSS_FACTOR = 10.0  # pretrain_gpt.py: SPIKY_LOSS_FACTOR = 10
MEGATRON_SPIKY_LOSS_SAMPLES = 100  # RerunStateMachine.is_unexpectedly_large(num_samples=100)
OLMO_SPIKE_WINDOW = 128  # StabilityMonitorCallback.window_size
OLMO_SPIKE_STD = 6.0  # StabilityMonitorCallback.threshold_std
QK_CLIP_THRESHOLD = 100.0  # TransformerConfig.qk_clip_threshold; MuonClip's τ = 100
ZCLIP_ALPHA = 0.97  # ZClip(alpha=0.97): EMA smoothing of the grad norm's mean and variance
ZCLIP_Z_THRESHOLD = 2.5  # ZClip(z_thresh=2.5)
ZCLIP_WARMUP_STEPS = 25  # ZClip(warmup_steps=25): grad norms buffered before the EMA starts
ZCLIP_EPS = 1e-6  # ZClip(eps=1e-6): added to the standard deviation in the z-score
FOUNDRY_PATIENCE = 4  # KillLossSpike(patience=4): the 5th consecutive outlier fires
FOUNDRY_OUTLIER_MULTIPLIER = 2.0  # KillLossSpike(outlier_multiplier=2)
FOUNDRY_MIN_WINDOW = 100  # _MIN_WINDOW_SIZE: the default (and smallest automatic) window, in batches
FOUNDRY_WINDOW_FRACTION = 0.05  # _WINDOW_FRACTION: the automatic window is this fraction of the training length
FOUNDRY_LOSS_CAP = 10.0  # _MAX_LOSS_CAP: the default loss cap
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
                             num_samples: int = MEGATRON_SPIKY_LOSS_SAMPLES, from_step: int = 1) -> Optional[int]:
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
        if value >= largest * factor and step >= from_step:
            return int(step)
    return None


def olmo_spike_step(values: Sequence[float], steps: Optional[Sequence[int]] = None,
                    window: int = OLMO_SPIKE_WINDOW, threshold_std: float = OLMO_SPIKE_STD,
                    from_step: int = 1) -> Optional[int]:
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
            if not std < 1e-10 and value > mean + threshold_std * std and step >= from_step:
                return int(step)
        history.append(value)
    return None


def zclip_spike_step(values: Sequence[float], steps: Optional[Sequence[int]] = None, *, alpha: float = ZCLIP_ALPHA,
                     z_threshold: float = ZCLIP_Z_THRESHOLD, warmup: int = ZCLIP_WARMUP_STEPS,
                     eps: float = ZCLIP_EPS, from_step: int = 1) -> Optional[int]:
    """ZClip's spike test on the grad norm: the first step whose z-score against the EMA mean and variance of the
    norms before it is above ``z_threshold``.

    Source: bluorion-com/ZClip, ``zclip/zclip.py`` (arXiv:2504.02507): ``ZClip.step``, ``_initialize_ema``,
    ``_compute_zscore``, ``_update_ema`` and ``_compute_clip_val`` (defaults ``alpha=0.97``, ``z_thresh=2.5``,
    ``warmup_steps=25``, ``eps=1e-6``, ``mode="zscore"``). Warm-up: the first ``warmup`` norms are only buffered,
    never judged; when the buffer holds ``warmup`` of them the EMA starts from their mean and their *population*
    variance. From the next norm ``g`` on: ``z = (g − mean) / (sqrt(var) + eps)``, a spike when ``z > z_threshold``
    (strict); then the EMA takes the norm — ``mean ← α·mean + (1 − α)·g``, ``var ← α·var + (1 − α)·(g − mean)²``
    with the *updated* mean. On a spike ZClip feeds the EMA its clipped value (``mean + z_thresh·std / (z /
    z_thresh)``) instead of ``g`` (or nothing, with ``skip_update_on_spike``): a spike before ``from_step`` is fed
    to the EMA so clipped, as ZClip does. A NaN is never a spike and, as in the source, turns the mean NaN for good
    (in the warm-up buffer too), after which nothing fires; an inf after the warm-up is a spike.
    """
    buffer: list = []
    mean = var = None
    for step, value in zip(_steps(values, steps), values):
        value = float(value)
        if mean is None:
            buffer.append(value)
            if len(buffer) >= warmup:
                mean = sum(buffer) / len(buffer)
                var = sum((x - mean) ** 2 for x in buffer) / len(buffer)
            continue
        std = math.sqrt(var) if not math.isnan(var) else math.nan
        z = (value - mean) / (std + eps) if not math.isnan(var) else math.nan
        if z > z_threshold:
            if step >= from_step:
                return int(step)
            value = mean + z_threshold * std / (z / z_threshold)  # ZClip feeds the EMA the clipped norm
        mean = alpha * mean + (1 - alpha) * value
        var = alpha * var + (1 - alpha) * (value - mean) ** 2
    return None


def foundry_loss_spike_step(values: Sequence[float], steps: Optional[Sequence[int]] = None, *,
                            train_steps: Optional[int] = None, patience: int = FOUNDRY_PATIENCE,
                            outlier_multiplier: float = FOUNDRY_OUTLIER_MULTIPLIER, window: Optional[int] = None,
                            loss_cap: Optional[float] = None, from_step: int = 1) -> Optional[int]:
    """llm-foundry's ``KillLossSpike`` callback: the first step at which either of its two checks fires — a loss
    spike (more than ``patience`` consecutive losses ``≥ outlier_multiplier ×`` the mean of the window before each)
    or persistently high losses (at least half the window above the loss cap).

    Source: mosaicml/llm-foundry, ``llmfoundry/callbacks/kill_loss_spike_callback.py``, ``KillLossSpike.batch_end``,
    ``_detect_loss_spike``, ``_detect_high_losses`` and ``_set_window_size`` (defaults ``patience=4``,
    ``outlier_multiplier=2``, ``window_size=_MIN_WINDOW_SIZE=100``, ``loss_cap=_MAX_LOSS_CAP=10``,
    ``_WINDOW_FRACTION=0.05``). Step ``s`` is the batch count at ``BATCH_END`` (Composer advances it before the
    event, so the first batch is step 1). Each loss is judged against the window of losses before it, then
    appended (spikes included). Nothing is judged until the window is full. ``window=None`` is the callback's
    default: when the 100-loss window first fills, it grows to ``max(100, round(0.05 × train_steps))`` (the
    run's length; without it the window stays 100) and, if it grew, that step is not judged and the window
    fills on. A given ``window`` is used as a fixed window of that many losses (the callback given its own
    ``window_size`` never bounds its deque, so it would judge one step only; this function judges every step,
    as the automatic window is used). Then, per step: the spike check (``loss ≥ outlier_multiplier ×
    mean(window)`` counts an outlier; the count firing when it exceeds ``patience``, a non-outlier resetting it);
    if it did not fire, the high-loss check from step ``2 × window`` on (``≥ window / 2`` of the window's losses
    ``> loss_cap``). ``loss_cap=None`` is the callback's default of 10, which it lowers to the largest loss of
    the first window only at the step that equals the window size — a step at which, counted from 1, the window
    (which fills at step ``window + 1``) is not yet full, so the cap stays 10; this function does the same.
    A NaN loss is never an outlier and, once in the window, keeps its mean NaN (no spike fires while it is
    there) — as in the source.
    """
    window_set = window is not None
    size = FOUNDRY_MIN_WINDOW if window is None else int(window)
    cap_set = loss_cap is not None
    cap = FOUNDRY_LOSS_CAP if loss_cap is None else float(loss_cap)
    history: deque = deque()
    outliers = 0
    for step, value in zip(_steps(values, steps), values):
        value = float(value)
        if len(history) == size:
            if not window_set:
                window_set = True
                if train_steps:
                    size = max(size, round(float(train_steps * FOUNDRY_WINDOW_FRACTION)))
                history = deque(history, maxlen=size)
                if size > FOUNDRY_MIN_WINDOW:
                    history.append(value)
                    continue
            if not cap_set and step == size:
                cap, cap_set = min(max(history), cap), True
            running_mean = sum(history) / len(history)
            if value >= running_mean * outlier_multiplier:
                outliers += 1
                if outliers > patience and step >= from_step:
                    return int(step)
            else:
                outliers = 0
            if step >= 2 * size and sum(1 for x in history if x > cap) >= size / 2 and step >= from_step:
                return int(step)
        history.append(value)
        if len(history) > size:
            history.popleft()
    return None


def qk_clip_step(values: Sequence[float], steps: Optional[Sequence[int]] = None,
                 threshold: float = QK_CLIP_THRESHOLD, from_step: int = 1) -> Optional[int]:
    """The first step whose maximum attention logit is above the QK-clip threshold.

    Source: megatron-core 0.19 ``megatron/core/transformer/attention.py`` (QK-clip rescales a head's query/key
    weights when ``max_attn_logits > qk_clip_threshold``; ``TransformerConfig.qk_clip_threshold`` defaults to 100)
    and ``megatron/training/training.py`` (``--log-max-attention-logit`` logs the model-wide maximum as
    ``max_attention_logit``); MuonClip (Kimi K2 technical report, arXiv:2507.20534) uses the same τ = 100. The
    comparison is strict, and a NaN never compares above it.
    """
    for step, value in zip(_steps(values, steps), values):
        if value > threshold and step >= from_step:
            return int(step)
    return None


def threshold_step(values: Sequence[float], level: float, steps: Optional[Sequence[int]] = None,
                   from_step: int = 1) -> Optional[int]:
    """A plain alarm level: the first step whose value is above ``level`` or not finite (an alarm on a grad norm
    reads a NaN or inf as over any level)."""
    for step, value in zip(_steps(values, steps), values):
        if (not math.isfinite(value) or value > level) and step >= from_step:
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
                      grad_norm_level: float = GRAD_NORM_LEVEL, from_step: int = 1) -> dict:
    """First firing step (or None) of each incumbent rule on one run, by rule name (at or after ``from_step``).

    ``losses``: the loss of every step from step 1 (its length is the run's length, which sizes llm-foundry's
    automatic window); ``grad_norm`` and ``max_logit``: ``(steps, values)`` as recorded (:func:`metric_series`);
    ``microbatches``: micro-batches per rank and step (Megatron's check counts micro-batch samples)."""
    gn_steps, gn = grad_norm
    ml_steps, ml = max_logit
    interval = (gn_steps[1] - gn_steps[0]) if len(gn_steps) > 1 else 1
    return {
        "Megatron spiky loss": megatron_spiky_loss_step(
            losses, num_samples=math.ceil(MEGATRON_SPIKY_LOSS_SAMPLES / microbatches), from_step=from_step),
        "OLMo loss spike": olmo_spike_step(losses, from_step=from_step),
        # OLMo-core judges every step's grad norm over 128 steps; the runs record it every `interval` steps, so the
        # window holds the records of the same 128 steps.
        "OLMo grad-norm spike": olmo_spike_step(gn, gn_steps, window=math.ceil(OLMO_SPIKE_WINDOW / interval),
                                                from_step=from_step),
        # ZClip updates its EMA every step; from a record every `interval` steps the same memory in steps is
        # alpha ** interval per record (a norm's weight decays as alpha per step), and its 25-step warm-up is the
        # records of those steps.
        "ZClip grad-norm z-score": zclip_spike_step(gn, gn_steps, alpha=ZCLIP_ALPHA ** interval,
                                                    warmup=math.ceil(ZCLIP_WARMUP_STEPS / interval),
                                                    from_step=from_step),
        "llm-foundry loss spike": foundry_loss_spike_step(losses, train_steps=len(losses), from_step=from_step),
        f"max logit > {QK_CLIP_THRESHOLD:g} (QK-clip)": qk_clip_step(ml, ml_steps, from_step=from_step),
        f"grad norm > {grad_norm_level:g}": threshold_step(gn, grad_norm_level, gn_steps, from_step=from_step),
    }


def per_step_grad_norms(grad_norms: Sequence[Optional[float]]) -> Optional[list]:
    """A run's per-step grad norms (``summary.json``'s ``grad_norms``) when the trainer gave one on any step, else
    None: the grad-norm rules then read the records' values (:func:`grad_norm_series`)."""
    return list(grad_norms) if any(value is not None for value in grad_norms) else None


def step_grad_norms(grad_norms: Sequence[Optional[float]]) -> tuple:
    """``(steps, values)`` of a run's per-step grad norms (``summary.json``'s ``grad_norms``: the grad norm of every
    step from step 1, ``None`` where the trainer gave none), the steps without a value left out."""
    pairs = [(step, float(value)) for step, value in enumerate(grad_norms, start=1) if value is not None]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def grad_norm_series(records: Iterable[Mapping], grad_norms: Optional[Sequence[Optional[float]]] = None) -> tuple:
    """``(steps, values)`` of the grad norm the grad-norm rules judge: every step's (``grad_norms``, from
    ``summary.json``, see :func:`step_grad_norms`), or, for a run recorded without it (``grad_norms`` None), the
    records' values every interval steps (:func:`incumbent_firings` then scales the rules' windows to the same
    steps; a firing step is known to the interval only)."""
    return step_grad_norms(grad_norms) if grad_norms is not None else metric_series(records, GRAD_NORM_METRIC)


def firing_steps(firings_from: Callable[[int], Mapping], rule: str, from_step: int) -> list:
    """Every step at which ``rule`` fires at or after ``from_step``: ``firings_from(step)`` gives each rule's first
    firing at or after ``step`` (e.g. :func:`run_incumbent_firings` of one run), asked again after each firing. How
    often a rule rings on a clean run says what its first firing after an onset is worth."""
    steps = []
    while (step := firings_from(from_step).get(rule)) is not None:
        steps.append(step)
        from_step = step + 1
    return steps


def grad_norm_reading(per_step: bool) -> str:
    """How the grad-norm rules read a run's grad norm, as a report states it (:func:`grad_norm_series`)."""
    return ("every step's grad norm (summary.json's grad_norms), as on a trainer" if per_step else
            "the grad norm at the monitor records only (every interval steps; OLMo-core's 128-step window and ZClip's "
            "per-step EMA and 25-step warm-up scaled to the same steps): a run recorded without its per-step grad "
            "norms")


def run_incumbent_firings(records: Iterable[Mapping], losses: Sequence[float], *, microbatches: int,
                          grad_norms: Optional[Sequence[Optional[float]]] = None,
                          grad_norm_level: float = GRAD_NORM_LEVEL, from_step: int = 1) -> dict:
    """:func:`incumbent_firings` of a run from its ``mech.jsonl`` records and per-step losses. ``grad_norms``: the
    grad norm of every step (``summary.json``'s ``grad_norms``), which the grad-norm rules judge as on a trainer;
    None for a run recorded without it (:func:`grad_norm_series`)."""
    records = list(records)
    return incumbent_firings(losses, grad_norm_series(records, grad_norms), metric_series(records, MAX_LOGIT_METRIC),
                             microbatches=microbatches, grad_norm_level=grad_norm_level, from_step=from_step)
