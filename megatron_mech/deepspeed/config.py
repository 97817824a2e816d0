"""The ``"mech"`` section of a DeepSpeed JSON config: parsed, validated, unknown keys rejected by name.

DeepSpeed keeps unknown *top-level* sections of its config in ``engine._config._param_dict`` without looking
at them, so a typo inside our section would otherwise be silently ignored for a whole run. Every key here is
checked before training; a bad one raises ``ValueError`` naming the full key path (``mech.mols.windw_steps``)
and the accepted keys.

Example::

    "mech": {
      "monitors": ["auto"],             # "attention", "router", "auto" (router when the model has MoE), or []
      "interval": 10,                   # δ: evaluate every 10 optimizer steps, ΔW spans 10 steps
      "qk_terms": ["delta1", "delta2", "delta3"],
      "output_dir": "runs/ds",          # mech.jsonl goes here (rank 0)
      "engine_monitor": true,           # also write through engine.monitor (TensorBoard/W&B/CSV/Comet)
      "detector": {"warmup": 20, "baseline": 30, "threshold": 6.0, "persistence": 3},
      "mols": {"enabled": true, "window_steps": 20, "ramp_end": 200}
    }
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from megatron_mech.core.detect import DetectorConfig, default_rules
from megatron_mech.core.mols import MoLSConfig
from megatron_mech.core.spectral import QK_METHODS, QK_TERMS

__all__ = ["SECTION", "DeepSpeedMechConfig", "MONITOR_FAMILIES", "read_section"]

SECTION = "mech"
MONITOR_FAMILIES = ("attention", "router")
_DETECTOR_KEYS = ("warmup", "baseline", "threshold", "persistence")
_MOLS_KEYS = ("enabled",) + tuple(f.name for f in dataclasses.fields(MoLSConfig))
_ATTENTION_LAYOUTS = ("auto", "separate", "grouped", "concatenated")


def _reject_unknown(where: str, given: Mapping[str, Any], allowed) -> None:
    if not isinstance(given, Mapping):
        raise ValueError(f"{where} must be a JSON object, got {type(given).__name__}")
    unknown = sorted(set(given) - set(allowed))
    if unknown:
        raise ValueError(f"unknown key(s) in the DeepSpeed config: {', '.join(f'{where}.{k}' for k in unknown)}; "
                         f"{where} accepts {', '.join(sorted(allowed))}")


def _int(where: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{where} must be an integer >= {minimum}, got {value!r}")
    return value


def _bool(where: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{where} must be true or false, got {value!r}")
    return value


@dataclass
class DeepSpeedMechConfig:
    """The validated ``"mech"`` section.

    Attributes:
        monitors: families to run: ``("auto",)`` = attention, plus router when the model has MoE routers;
            ``()`` = none; or a subset of ``("attention", "router")`` (router on a dense model is an error).
        interval: δ in optimizer steps: snapshot and evaluate on multiples of δ; ΔW spans δ steps.
        qk_terms: QK-increment terms computed per head (``delta1``, ``delta2``, ``delta3``).
        qk_method: core of the compressed QK spectra, ``gram`` or ``qr``.
        snapshot_device: where the ``W_{t−δ}`` snapshots live: ``cpu`` (host memory) or ``device``.
        checkpoint_snapshots: save the snapshots with the checkpoint so a resumed run continues the series
            exactly (otherwise the first interval after a resume re-snapshots and is skipped).
        attention_layout: how attention weights are stored: ``auto`` (detect: separate ``q_proj``/``k_proj``,
            else a fused ``qkv_proj``/``query_key_value``/``Wqkv``), ``separate``, ``grouped`` (fused, rows
            grouped per KV group: Megatron, GPT-NeoX, Falcon) or ``concatenated`` (fused ``[Q | K | V]``:
            Phi-3 ``qkv_proj``).
        output_dir: directory of ``mech.jsonl`` (written by global rank 0); None: no JSONL.
        engine_monitor: also write every record through ``engine.monitor`` (the TensorBoard / W&B / CSV /
            Comet backends configured in the DeepSpeed config).
        detector: overrides applied to every default detector rule (``warmup``, ``baseline``, ``threshold``,
            ``persistence``).
        mols: a :class:`MoLSConfig` when ``mols.enabled`` is true, else None.
    """

    monitors: tuple = ("auto",)
    interval: int = 10
    qk_terms: tuple = QK_TERMS
    qk_method: str = "gram"
    snapshot_device: str = "cpu"
    checkpoint_snapshots: bool = True
    attention_layout: str = "auto"
    output_dir: Optional[str] = None
    engine_monitor: bool = True
    detector: dict = field(default_factory=dict)
    mols: Optional[MoLSConfig] = None

    @classmethod
    def from_dict(cls, section: Optional[Mapping[str, Any]]) -> "DeepSpeedMechConfig":
        """Parse the section (None or absent: every default). Raises ``ValueError`` naming ``mech.<key>``."""
        if section is None:
            return cls()
        allowed = {f.name for f in dataclasses.fields(cls)} - {"attention_layout"} | {"attention"}
        _reject_unknown(SECTION, section, allowed)
        kw: dict[str, Any] = {}
        if "monitors" in section:
            monitors = section["monitors"]
            if isinstance(monitors, str) or not isinstance(monitors, (list, tuple)):
                raise ValueError(f"mech.monitors must be a list, got {monitors!r}")
            bad = [m for m in monitors if m not in (*MONITOR_FAMILIES, "auto")]
            if bad:
                raise ValueError(f"mech.monitors: unknown monitor family {bad}; expected some of "
                                 f"{MONITOR_FAMILIES} or ['auto'] or []")
            if "auto" in monitors and len(monitors) > 1:
                raise ValueError(f"mech.monitors: 'auto' cannot be combined with other families, got {monitors}")
            kw["monitors"] = tuple(monitors)
        if "interval" in section:
            kw["interval"] = _int("mech.interval", section["interval"], 1)
        if "qk_terms" in section:
            terms = section["qk_terms"]
            if isinstance(terms, str) or not isinstance(terms, (list, tuple)) or \
                    any(t not in QK_TERMS for t in terms) or len(set(terms)) != len(terms):
                raise ValueError(f"mech.qk_terms must be a list of distinct terms from {QK_TERMS}, got {terms!r}")
            kw["qk_terms"] = tuple(terms)
        if "qk_method" in section:
            if section["qk_method"] not in QK_METHODS:
                raise ValueError(f"mech.qk_method must be one of {QK_METHODS}, got {section['qk_method']!r}")
            kw["qk_method"] = section["qk_method"]
        if "snapshot_device" in section:
            if section["snapshot_device"] not in ("cpu", "device"):
                raise ValueError(f"mech.snapshot_device must be 'cpu' or 'device', got "
                                 f"{section['snapshot_device']!r}")
            kw["snapshot_device"] = section["snapshot_device"]
        for key in ("checkpoint_snapshots", "engine_monitor"):
            if key in section:
                kw[key] = _bool(f"mech.{key}", section[key])
        if "output_dir" in section:
            if section["output_dir"] is not None and not isinstance(section["output_dir"], str):
                raise ValueError(f"mech.output_dir must be a path string or null, got {section['output_dir']!r}")
            kw["output_dir"] = section["output_dir"]
        if "attention" in section:
            _reject_unknown("mech.attention", section["attention"], ("layout",))
            layout = section["attention"].get("layout", "auto")
            if layout not in _ATTENTION_LAYOUTS:
                raise ValueError(f"mech.attention.layout must be one of {_ATTENTION_LAYOUTS}, got {layout!r}")
            kw["attention_layout"] = layout
        if "detector" in section:
            _reject_unknown("mech.detector", section["detector"], _DETECTOR_KEYS)
            detector = dict(section["detector"])
            for rule in default_rules():  # validate now, not at the first evaluation
                try:
                    dataclasses.replace(rule, **detector).config(DetectorConfig())
                except (TypeError, ValueError) as e:
                    raise ValueError(f"mech.detector: {e}") from None
            kw["detector"] = detector
        if "mols" in section:
            mols = section["mols"]
            _reject_unknown("mech.mols", mols, _MOLS_KEYS)
            if _bool("mech.mols.enabled", mols.get("enabled", True)):
                settings = {k: v for k, v in mols.items() if k != "enabled"}
                settings.setdefault("window_steps", 20)
                if settings.get("estimator", "two_batch") != "two_batch":
                    raise ValueError("mech.mols.estimator: the DeepSpeed adapter measures the two_batch estimator "
                                     "(micro-batch vs reduced gradient) only")
                try:
                    kw["mols"] = MoLSConfig.from_dict(settings)
                except (TypeError, ValueError) as e:
                    raise ValueError(f"mech.mols: {e}") from None
        return cls(**kw)

    def detector_rules(self):
        """The default detector rules with ``detector`` overrides applied to every rule."""
        return [dataclasses.replace(rule, **self.detector) for rule in default_rules()]


def read_section(config: Any) -> Optional[Mapping[str, Any]]:
    """The raw ``"mech"`` section from a DeepSpeed config given as a dict, a JSON path, a ``DeepSpeedConfig`` or
    an engine (``engine._config._param_dict``, where DeepSpeed keeps sections it does not know)."""
    import json

    if hasattr(config, "_config"):          # an engine
        config = config._config
    if hasattr(config, "_param_dict"):      # a DeepSpeedConfig
        config = config._param_dict
    if isinstance(config, (str, bytes)) or hasattr(config, "__fspath__"):
        with open(config, encoding="utf-8") as f:
            config = json.load(f)
    if not isinstance(config, Mapping):
        raise ValueError(f"cannot read a DeepSpeed config from {type(config).__name__}")
    return config.get(SECTION)
