"""``summary.json`` for the tests: one written as a run writes it, and the schema check every trainer's is held to.

The schema is checked against a list written out here, apart from the reader's own table: a field added, dropped
or renamed in :class:`~megatron_mech.records.run_summary.RunSummary` fails the trainers' tests until this list and
``docs/outputs.md`` follow.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

# Every top-level field of summary.json (schema_version 1) and the JSON type of its value (None: may be null).
SCHEMA = {
    "schema_version": int, "final_step": int, "first_step": int, "losses": list, "grad_norms": list,
    "step_seconds": (list, None), "alerts": list, "attribution": list, "detectors": dict, "diagnosis": (dict, None),
    "verdict": str, "monitor_seconds": float, "monitor_breakdown": dict, "mols_seconds": float,
    "mols_diagnostic_seconds": float, "mols_diagnostics": list, "final_mols": dict, "records_lost_steps": list,
    "optimizer_steps_skipped": int, "async_evaluation": dict, "extensions": dict, "trainer": dict,
}
ALERT_KEYS = {"step", "family", "metric", "value", "baseline", "score", "detail"}


def a_summary(**fields):
    """A fresh hook's :class:`~megatron_mech.records.run_summary.RunSummary`, with ``fields`` replaced."""
    from megatron_mech.config import MechConfig
    from megatron_mech.hook import MechHook

    return dataclasses.replace(MechHook(MechConfig()).run_summary(), **fields)


def write_summary_file(path, **fields) -> Path:
    """A ``summary.json`` at ``path`` as a run writes it (:func:`a_summary`), through the one writer."""
    from megatron_mech.records.run_summary import write_run_summary

    assert write_run_summary(path, a_summary(**fields))
    return Path(path)


def assert_summary_schema(path, trainer_keys):
    """The ``summary.json`` at ``path`` has exactly the fields of :data:`SCHEMA`, each of its type, its alerts are
    dicts, the monitors' time is the sum of ``monitor_breakdown`` and MoLS's is not in it, its ``trainer``
    holds exactly ``trainer_keys``, and the reader takes it. Returns the raw JSON object and the read summary."""
    raw = json.loads(Path(path).read_text())
    assert set(raw) == set(SCHEMA), (sorted(set(raw) - set(SCHEMA)), sorted(set(SCHEMA) - set(raw)))
    assert list(raw)[0] == "schema_version" and raw["schema_version"] == 1
    for name, kind in SCHEMA.items():
        kinds = kind if isinstance(kind, tuple) else (kind,)
        value = raw[name]
        assert (value is None and None in kinds) or (type(value) in kinds and value is not None), (name, value)
    assert all(isinstance(a, dict) and set(a) == ALERT_KEYS for a in raw["alerts"]), raw["alerts"]
    # the monitors' time is the sum of its parts, MoLS's not among them
    assert "mols" not in raw["monitor_breakdown"]
    assert raw["monitor_seconds"] == pytest.approx(sum(raw["monitor_breakdown"].values()), rel=1e-9, abs=1e-12)
    assert set(raw["trainer"]) == set(trainer_keys), sorted(raw["trainer"])
    from megatron_mech.records.run_summary import SCHEMA_VERSION, read_run_summary

    assert SCHEMA_VERSION == 1
    return raw, read_run_summary(path)
