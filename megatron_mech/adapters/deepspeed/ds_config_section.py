"""The ``"mech"`` section of a DeepSpeed JSON config: parsed, validated, unknown keys rejected by name.

DeepSpeed keeps unknown *top-level* sections of its config in ``engine._config._param_dict`` without looking
at them, so a typo inside our section would otherwise be silently ignored for a whole run. The section is
:class:`megatron_mech.config.MechConfig` as a dict (the same settings as the ``--mech-*`` flags of the
Megatron adapters), plus one DeepSpeed-only subsection ``"deepspeed"`` (:class:`DeepSpeedOptions`). Every key
is checked when the adapter is built, before training; a bad one raises ``ValueError`` naming the full key
path (``mech.mols.windw``) and what is accepted.

Example::

    "mech": {
      "monitors": {"families": ["auto"], "interval": 10},   # attention, plus router when the model has MoE
      "detector": {"warmup": 20, "baseline": 30},
      "mols": {"enabled": true, "window": 20},
      "output": {"dir": "runs/ds"},                         # mech.jsonl (global rank 0)
      "on_alert": "log",
      "deepspeed": {"engine_monitor": true, "attention_layout": "auto"}
    }
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from megatron_mech.config import MechConfig
from megatron_mech.options import check_mapping, option, section_from_dict

__all__ = ["ATTENTION_LAYOUTS", "SECTION", "DeepSpeedOptions", "load_config_file", "parse_section", "read_section"]

SECTION = "mech"
ATTENTION_LAYOUTS = ("auto", "separate", "grouped", "concatenated")


@dataclass(frozen=True)
class DeepSpeedOptions:
    """Settings only the DeepSpeed adapter has (``mech.deepspeed``); no flags (they live in the JSON config)."""

    engine_monitor: bool = option(True, "also write every record through engine.monitor (the TensorBoard / W&B / "
                                  "CSV / Comet backends of the DeepSpeed config; DeepSpeed writes them from rank 0)")
    attention_layout: str = option("auto", "how attention weights are stored: auto (separate q_proj/k_proj if "
                                   "present, else a known fused name with its usual layout), separate, grouped "
                                   "(fused, rows grouped per KV group: Megatron, GPT-NeoX, Falcon) or concatenated "
                                   "(fused [Q | K | V]: Phi-3, MPT, GPT-2)", choices=ATTENTION_LAYOUTS)

    def __post_init__(self):
        if not isinstance(self.engine_monitor, bool):
            raise ValueError(f"mech.deepspeed.engine_monitor must be true or false, got {self.engine_monitor!r}")
        if self.attention_layout not in ATTENTION_LAYOUTS:
            raise ValueError(f"mech.deepspeed.attention_layout must be one of {ATTENTION_LAYOUTS}, got "
                             f"{self.attention_layout!r}")


_ABSENT = object()


def parse_section(section: Optional[Mapping[str, Any]]) -> tuple[MechConfig, DeepSpeedOptions]:
    """The ``"mech"`` section → ``(MechConfig, DeepSpeedOptions)``. None/absent: every default. Raises
    ``ValueError`` naming ``mech.<key>`` for unknown keys and bad values (types checked against the settings'
    declarations, :func:`megatron_mech.options.section_from_dict`)."""
    if section is None:
        return MechConfig(), DeepSpeedOptions()
    check_mapping(section, SECTION)
    section = dict(section)
    ds = section.pop("deepspeed", _ABSENT)
    options = DeepSpeedOptions()
    if ds is not _ABSENT:
        check_mapping(ds, f"{SECTION}.deepspeed")  # null too: like every nested section, an object when present
        options = section_from_dict(DeepSpeedOptions, ds, f"{SECTION}.deepspeed")
    config = MechConfig.from_dict(section, SECTION, other_keys=("deepspeed",))
    if config.monitors.all_linears:
        raise ValueError("mech.monitors.all_linears is not available in the DeepSpeed adapter (attention Q/K and "
                         "routers only)")
    return config, options


class _Pairs(list):
    """A JSON object as read, its ``(key, value)`` pairs in order, duplicates kept (to be found)."""


def _objects_without_duplicates(value: Any, source, where: str) -> Any:
    """``value`` with every :class:`_Pairs` turned into a dict; ``ValueError`` naming ``source`` and the key's
    path when an object holds a key twice."""
    if isinstance(value, _Pairs):
        out = {}
        for key, item in value:
            path = f"{where}.{key}" if where else key
            if key in out:
                raise ValueError(f"DeepSpeed config {source}: key {path!r} appears twice; JSON keeps only the last, "
                                 f"silently dropping the first setting. Keep one")
            out[key] = _objects_without_duplicates(item, source, path)
        return out
    if isinstance(value, list):
        return [_objects_without_duplicates(item, source, where) for item in value]
    return value


def load_config_file(path) -> Any:
    """A DeepSpeed JSON config file, parsed; a key given twice in one object (``"interval"`` twice in
    ``"mech": {"monitors": {...}}``) is a ``ValueError`` naming the file and the key's path (``mech.monitors.
    interval``): JSON keeps the last one, dropping the first without a word (DeepSpeed refuses duplicates too
    when it reads a config file itself)."""
    with open(path, encoding="utf-8") as f:
        raw = json.load(f, object_pairs_hook=_Pairs)
    return _objects_without_duplicates(raw, path, "")


def read_section(config: Any) -> Optional[Mapping[str, Any]]:
    """The raw ``"mech"`` section of a DeepSpeed config given as a dict, a JSON path, a ``DeepSpeedConfig`` or an
    engine (``engine._config._param_dict``, where DeepSpeed keeps the sections it does not know)."""
    if hasattr(config, "_config"):          # an engine
        config = config._config
    if hasattr(config, "_param_dict"):      # a DeepSpeedConfig
        config = config._param_dict
    if isinstance(config, (str, bytes)) or hasattr(config, "__fspath__"):
        config = load_config_file(config)
    if not isinstance(config, Mapping):
        raise ValueError(f"cannot read a DeepSpeed config from {type(config).__name__}")
    return config.get(SECTION)
