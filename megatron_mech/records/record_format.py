"""The one record layout of megatron-mech's output and its strict-JSON encoding (see
:mod:`megatron_mech.records.sinks` for the layout and the NaN/inf rule): :func:`make_record`, :func:`encode_record`,
:func:`decode_record`, and what a writer (TensorBoard, W&B, DeepSpeed's monitor) gets of a record
(:func:`record_scalars`, :func:`alert_markers`, :func:`loss_and_alerts_layout`)."""
from __future__ import annotations

import json
import math
from typing import Any, Iterable, Mapping, Sequence

from megatron_mech.core.detect import Alert
from megatron_mech.records.writer_level import WriterLevel

__all__ = ["RESERVED_KEYS", "alert_markers", "decode_record", "encode_record", "loss_and_alerts_layout",
           "make_record", "record_alerts", "record_scalars"]

#: Keys of a record that :func:`make_record` owns (``extra`` may not override them).
RESERVED_KEYS = ("step", "loss", "lr", "grad_norm", "metrics", "alerts")
_STANDARD_SCALARS = ("loss", "lr", "grad_norm")
_STR_TO_FLOAT = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


# ------------------------------------------------------------------------------------------------ encoding
def _float_or_none(x: Any) -> float | None:
    if x is None:
        return None
    if hasattr(x, "item") and not isinstance(x, (int, float)):  # 0-d torch tensor / numpy scalar
        x = x.item()
    if isinstance(x, bool):
        raise TypeError(f"expected a number, got bool {x!r}")
    return float(x)


def _encode_float(x: float) -> float | str:
    if math.isfinite(x):
        return x
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")


def _to_json_safe(obj: Any) -> Any:
    """Plain JSON types, non-finite floats as strings; numpy/torch scalars via ``.item()``; Alerts via to_dict."""
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return _encode_float(float(obj))
    if isinstance(obj, Alert):
        return _to_json_safe(obj.to_dict())
    if isinstance(obj, Mapping):
        return {str(k): _to_json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_to_json_safe(v) for v in obj]
    if hasattr(obj, "item") and callable(obj.item):
        try:
            return _to_json_safe(obj.item())
        except (ValueError, RuntimeError) as e:  # a tensor/array with more than one element
            raise TypeError(f"cannot log a non-scalar {type(obj).__name__} in a record") from e
    raise TypeError(f"cannot log a {type(obj).__name__} in a record: {obj!r}")


def decode_record(obj: Any) -> Any:
    """Inverse of the encoding: the strings ``"nan"``, ``"inf"``, ``"-inf"`` become floats, anywhere."""
    if isinstance(obj, str):
        return _STR_TO_FLOAT.get(obj, obj)
    if isinstance(obj, dict):
        return {k: decode_record(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode_record(v) for v in obj]
    return obj


def encode_record(record: Mapping[str, Any]) -> str:
    """One strict-JSON line (no newline) for ``record``; needs an int ``step``."""
    step = record.get("step")
    if isinstance(step, bool) or not isinstance(step, int):
        raise ValueError(f"a record needs an int 'step', got {step!r}")
    return json.dumps(_to_json_safe(record), allow_nan=False, separators=(",", ":"))


def make_record(step: int, scalars: Mapping[str, Any] | None = None, metrics: Mapping[str, Any] | None = None,
                alerts: Iterable[Alert | Mapping[str, Any]] = (), extra: Mapping[str, Any] | None = None
                ) -> dict[str, Any]:
    """The one record layout (see the module docstring).

    Args:
        step: training step (iteration) the record describes.
        scalars: training scalars; ``loss``, ``lr`` and ``grad_norm`` are always present in the record (None if
            not given), any other key (e.g. ``tokens_per_s``) is added as a top-level float. Values may be
            Python/numpy numbers or 0-d tensors; None means not measured.
        metrics: monitor series ``{name: value}`` (floats or None).
        alerts: :class:`Alert` objects (or their ``to_dict()``) fired at this step.
        extra: more top-level entries (e.g. ``{"mols": {...}}``); JSON-able values, may not override
            :data:`RESERVED_KEYS`.
    """
    if isinstance(step, bool) or not isinstance(step, int):
        if hasattr(step, "item"):
            step = step.item()
        if isinstance(step, bool) or not isinstance(step, int):
            raise TypeError(f"step must be an int, got {step!r}")
    scalars = dict(scalars or {})
    rec: dict[str, Any] = {"step": int(step)}
    for k in _STANDARD_SCALARS:
        rec[k] = _float_or_none(scalars.pop(k, None))
    rec["metrics"] = {str(k): _float_or_none(v) for k, v in (metrics or {}).items()}
    rec["alerts"] = [a.to_dict() if isinstance(a, Alert) else Alert.from_dict(a).to_dict() for a in alerts]
    for k, v in scalars.items():
        if k in RESERVED_KEYS:
            raise ValueError(f"scalar {k!r} clashes with a reserved record key")
        rec[str(k)] = _float_or_none(v)
    for k, v in (extra or {}).items():
        if k in rec:
            raise ValueError(f"extra key {k!r} clashes with an existing record key")
        _to_json_safe(v)  # fail now, not in the sink, if it cannot be logged
        rec[str(k)] = v
    return rec


def record_alerts(record: Mapping[str, Any]) -> list[Alert]:
    """The record's alerts as :class:`Alert` objects."""
    return [Alert.from_dict(a) for a in record.get("alerts") or ()]


def _flatten_numbers(prefix: str, obj: Any, out: dict[str, float]) -> None:
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            _flatten_numbers(f"{prefix}/{k}", v, out)
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        out[prefix] = float(obj)


def record_scalars(record: Mapping[str, Any], prefix: str = "mech") -> dict[str, float]:
    """Flat ``{tag: value}`` of every number in a record, the tag layout shared by the scalar sinks:

    * ``metrics[name]`` → ``{prefix}/{name}`` (so ``mech/attn/layer1/dwq_entropy``, ``mech/symptom/loss``, ...);
    * ``loss``, ``grad_norm`` → ``{prefix}/symptom/loss``, ``{prefix}/symptom/grad_norm`` (unless the metrics
      already hold ``symptom/loss`` / ``symptom/grad_norm``, which win);
    * ``lr`` and any other top-level number (e.g. ``tokens_per_s``) → ``{prefix}/train/{key}``;
    * numbers nested in other top-level dicts, e.g. ``mols`` → ``{prefix}/mols/...``.

    None values are skipped; non-finite floats are kept.
    """
    out: dict[str, float] = {}
    metrics = record.get("metrics") or {}
    for name, v in metrics.items():
        if v is not None:
            out[f"{prefix}/{name}"] = float(v)
    for key, v in record.items():
        if key in ("step", "metrics", "alerts") or v is None:
            continue
        if key in ("loss", "grad_norm"):
            if f"symptom/{key}" not in metrics and not isinstance(v, bool):
                out[f"{prefix}/symptom/{key}"] = float(v)
        elif isinstance(v, Mapping):
            for sub, x in v.items():
                # The mols section's names already carry the section ("mols/snr/qk"): no second "mols/" level.
                sub = str(sub)
                _flatten_numbers(f"{prefix}/{sub}" if sub.startswith(f"{key}/") else f"{prefix}/{key}/{sub}", x, out)
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[f"{prefix}/train/{key}"] = float(v)
    return out


def _alerts_text(alerts: Sequence[Alert]) -> str:
    return "\n".join(f"- {a.describe()}" for a in alerts)


def alert_markers(alerts: Sequence[Alert], prefix: str = "mech") -> dict[str, float]:
    """``{prefix}/alerts/<family>`` = number of the family's alerts at this step, for the families that fired (none
    at a step without alerts): markers on the scalar charts, where the loss (``{prefix}/symptom/loss``) is."""
    counts: dict[str, float] = {}
    for a in alerts:
        tag = f"{prefix}/alerts/{a.family}"
        counts[tag] = counts.get(tag, 0.0) + 1.0
    return counts


def _writer_scalars(record: Mapping[str, Any], alerts: Sequence[Alert], level: WriterLevel,
                    prefix: str) -> dict[str, float]:
    """What a writer (TensorBoard, W&B, DeepSpeed's monitor) gets of a record: :func:`record_scalars` of the
    record with its metrics at the writer's level, then the alert markers."""
    metrics = level.metrics(record.get("metrics") or {}, [a.metric for a in alerts])
    return {**record_scalars({**record, "metrics": metrics}, prefix), **alert_markers(alerts, prefix)}


def loss_and_alerts_layout(prefix: str = "mech") -> dict:
    """TensorBoard's custom-scalars layout (``SummaryWriter.add_custom_scalars``): one chart of the loss with
    the alert markers, one of the grad norm with them (TensorBoard draws separate tags on separate charts
    otherwise; the Multiline entries are regular expressions)."""
    alerts = f"{prefix}/alerts/.*"
    return {prefix: {"loss and alerts": ["Multiline", [f"{prefix}/symptom/loss", alerts]],
                     "grad norm and alerts": ["Multiline", [f"{prefix}/symptom/grad_norm", alerts]]}}
