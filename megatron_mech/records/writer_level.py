"""How much of a record the writers a user watches (TensorBoard, W&B, DeepSpeed's monitor) receive: every series
(``full``) or a summary (``summary``); ``auto`` picks by the size of an evaluation. ``mech.jsonl`` always keeps
every series, whatever the level.

**Per-unit series.** A name ``<family>/layer{L}/<unit><i>/<metric>`` — a head (``attn/layer3/head17/delta2_entropy``),
an expert (``expert/layer5/e200/update_ratio``), a TP slice (``attn/layer3/tp1/dwq_entropy``) — is one series of one
unit of a layer. At frontier shapes these are most of an evaluation's series, more than W&B's recommended 10,000
distinct metrics of a project (counts per model shape: ``docs/results/calibration.md``).

**Summary.** Every series that is not per-unit (per-layer series, symptoms, extra linears) as it is; each per-unit
family reduced over the layer's units to ``<family>/layer{L}/<unit>_min/<metric>`` and ``.../<unit>_mean/<metric>``
(``attn/layer3/head_min/delta2_entropy``: the lowest head of layer 3); and, at a step with alerts, every series of each
alerting unit — the alert's series' parent: its head or expert, or for a per-layer series its whole layer — so the
faulty head's own curve is there at the steps it alerts. Loss, grad norm, lr and the alert markers are written at
every level (:func:`~megatron_mech.records.sinks.record_scalars`).
"""
from __future__ import annotations

import logging
import math
import re
from typing import Iterable, Mapping, Optional

__all__ = ["AUTO_SUMMARY_SERIES", "WRITER_LEVELS", "WriterLevel", "alerting_units", "per_unit_family",
           "summary_metrics"]

logger = logging.getLogger(__name__)

WRITER_LEVELS = ("auto", "full", "summary")
#: ``auto`` summarizes from the first record holding more series than this: a fifth of W&B's recommended
#: 10,000 distinct metrics of a *project* (several runs and the trainer's own metrics share it). A 70B-shaped model
#: writes ~17,000 series per evaluation, a DeepSeek-style MoE ~27,000 (~60,000 with ``--mech-experts``); a small
#: model (≤ 24 layers × 16 heads: ~1,600) stays ``full``.
AUTO_SUMMARY_SERIES = 2000

_PER_UNIT = re.compile(r"^(?P<layer>(?:.*/)?layer\d+)/(?P<unit>[A-Za-z_]+)\d+/(?P<metric>.+)$")


def per_unit_family(name: str) -> Optional[tuple[str, str, str]]:
    """``(layer part, unit kind, metric)`` of a per-unit series (``attn/layer3/head17/delta2_entropy`` →
    ``("attn/layer3", "head", "delta2_entropy")``), or None for any other series."""
    match = _PER_UNIT.match(name)
    return (match["layer"], match["unit"], match["metric"]) if match else None


def alerting_units(alert_metrics: Iterable[str]) -> list[str]:
    """The name prefixes (ending in ``/``) of the units the alerts' series belong to: the series' parent."""
    return list(dict.fromkeys(name.rsplit("/", 1)[0] + "/" for name in alert_metrics if "/" in name))


def summary_metrics(metrics: Mapping[str, Optional[float]], alert_metrics: Iterable[str] = ()
                    ) -> dict[str, Optional[float]]:
    """The summary of one record's ``metrics`` (module docstring).

    Args:
        metrics: ``{name: float or None}`` (one record's ``metrics``; None = not measured, skipped by the
            reductions).
        alert_metrics: the series names of the alerts fired at this step.

    Returns ``{name: float or None}``. A reduction over units one of which is NaN is NaN (a NaN is itself a fault
    sign, as in the monitors' own head aggregates); a family whose units are all unmeasured is left out.
    """
    out: dict[str, Optional[float]] = {}
    families: dict[tuple[str, str, str], list[float]] = {}
    for name, value in metrics.items():
        family = per_unit_family(name)
        if family is None:
            out[name] = value
        else:
            values = families.setdefault(family, [])
            if value is not None:
                values.append(float(value))
    for (layer, unit, metric), values in families.items():
        if not values:
            continue
        nan = any(math.isnan(v) for v in values)
        out[f"{layer}/{unit}_min/{metric}"] = math.nan if nan else min(values)
        out[f"{layer}/{unit}_mean/{metric}"] = math.nan if nan else sum(values) / len(values)
    units = alerting_units(alert_metrics)
    if units:
        for name, value in metrics.items():
            if name.startswith(tuple(units)):
                out[name] = value
    return out


class WriterLevel:
    """The level one writer runs at, and what it writes of each record (:meth:`metrics`).

    ``level``: ``"full"`` (every series), ``"summary"`` (:func:`summary_metrics`) or ``"auto"``: full until a record
    holds more than ``auto_limit`` series, summary from that record on (a run's evaluations have the same size, so
    the first evaluation decides; a writer never goes back to full, so a chart does not stop and restart).
    """

    def __init__(self, level: str = "full", *, auto_limit: int = AUTO_SUMMARY_SERIES) -> None:
        if level not in WRITER_LEVELS:
            raise ValueError(f"writer level must be one of {', '.join(WRITER_LEVELS)}, got {level!r}")
        self.level = level
        self.auto_limit = auto_limit
        self.summarizing = level == "summary"

    def metrics(self, metrics: Mapping[str, Optional[float]], alert_metrics: Iterable[str] = ()
                ) -> Mapping[str, Optional[float]]:
        """What a writer gets of one record's ``metrics`` (alerts: the series names of the record's alerts)."""
        if self.level == "auto" and not self.summarizing and len(metrics) > self.auto_limit:
            self.summarizing = True
            logger.info("megatron-mech: an evaluation records %d series (more than %d): TensorBoard/W&B get the "
                        "per-layer summary from now on (mech.jsonl keeps every series; --mech-writer-level full, "
                        "mech.output.writer_level \"full\" in a DeepSpeed config, writes them all)",
                        len(metrics), self.auto_limit)
        return summary_metrics(metrics, alert_metrics) if self.summarizing else metrics
