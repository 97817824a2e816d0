"""A run's ``summary.json``: one schema, one writer, one reader, whichever trainer ran.

:class:`RunSummary` holds what the hook knows of a run (its alerts and their diagnosis, the detectors' arming, the
monitors' and MoLS's cost, each step's loss and grad norm, the records that could not be written) plus a
``trainer`` mapping of the trainer's own fields (a validation loss, the DeepSpeed ZeRO stage...). The hook fills
it (``MechHook.run_summary``, through :func:`build_run_summary`); the megatron-core entry point, the Megatron-LM
fork's call sites and the DeepSpeed adapter write it with :func:`write_run_summary`; the report and the studies
read it with :func:`read_run_summary`, which checks the file's ``schema_version`` and every field's type and names
the file and the field when one is wrong. ``docs/outputs.md`` describes each field.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence

from megatron_mech.core.checks import is_int
from megatron_mech.core.detect import Alert
from megatron_mech.records.safe_files import read_small_file, write_file_atomically

__all__ = ["MAX_SUMMARY_BYTES", "SCHEMA_VERSION", "RunSummary", "build_run_summary", "read_run_summary",
           "run_verdict", "write_run_summary"]

logger = logging.getLogger(__name__)

#: The version of the ``summary.json`` schema this package writes and reads; a file of another version is refused
#: by name (fields changed meaning or place between versions).
SCHEMA_VERSION = 1
#: A run's ``summary.json`` larger than this is not read (it would take many times its size in memory to decode). A
#: summary keeps at most a bounded window of per-step series, a few MB; see docs/reliability.md.
MAX_SUMMARY_BYTES = 16 * 2**20

_NUMBER = (int, float)


@dataclass
class RunSummary:
    """One run's summary, as ``summary.json`` holds it (``docs/outputs.md`` describes each field)."""

    final_step: int
    """The last optimizer step the run took, counted from step 1 across resumes."""
    first_step: int
    """The step of ``losses[0]`` and ``grad_norms[0]`` (1 unless the run outlived the series' window)."""
    losses: List[float]
    """Each step's loss from ``first_step`` on (NaN where it was not finite)."""
    grad_norms: List[Optional[float]]
    """Each step's global gradient norm beside its loss (None where the trainer gave none)."""
    step_seconds: Optional[List[float]]
    """Wall time of each step this process ran, as the trainer timed it; None when the trainer does not time its
    steps (a Megatron-LM fork)."""
    alerts: List[Dict[str, Any]]
    """Every alert of the run, in order (``Alert.to_dict``: step, family, metric, value, baseline, score, detail)."""
    attribution: List[str]
    """The alerts grouped by cause, subsystem and layer, one line per group, earliest first."""
    detectors: Dict[str, Any]
    """The detectors' arming (``MechHook.arming``): ``armed_from_step``, ``last_step``, ``armed``, ``note``,
    ``rule_overrides`` and, when the run has them, ``level_rules``, ``layer_trends``, ``update_ratio_jump``."""
    diagnosis: Optional[Dict[str, Any]]
    """The first alert's diagnosis (its cause, step and evidence); None without alerts."""
    verdict: str
    """One sentence: the first alert, or whether a run without alerts was armed at all."""
    monitor_seconds: float
    """Wall time this process spent in the monitors (snapshots, evaluations, detectors, output, captures);
    MoLS is apart (``mols_seconds``)."""
    monitor_breakdown: Dict[str, float]
    """``monitor_seconds`` by part (attention, router, detectors, output, router_capture, max_logit_capture...)."""
    mols_seconds: float
    """Wall time MoLS spent measuring and applying on this process (0 without MoLS)."""
    mols_diagnostic_seconds: float
    """Wall time of MoLS's post-window SNR diagnostic (not in ``mols_seconds``)."""
    mols_diagnostics: List[Any]
    """MoLS's post-window diagnostic blocks (empty without the diagnostic)."""
    final_mols: Dict[str, Any]
    """MoLS's SNR, α and multiplier values in force after the last step (empty without MoLS)."""
    records_lost_steps: List[int]
    """Steps whose ``mech.jsonl`` record could not be written or lacks the monitors' metrics."""
    optimizer_steps_skipped: int
    """Optimizer steps the trainer reported skipped (fp16 overflow), across resumes."""
    async_evaluation: Dict[str, Any]
    """Whether the evaluation ran beside training (``enabled``), the training thread's ``wait_seconds``, and the
    ``failure`` that switched the monitors off (None when there was none)."""
    extensions: Dict[str, Any]
    """Each hook extension's own summary, by extension name (only those that give one)."""
    trainer: Dict[str, Any]
    """The trainer's own fields (``docs/outputs.md`` lists each trainer's)."""
    schema_version: int = field(default=SCHEMA_VERSION)
    """The version of this schema (:data:`SCHEMA_VERSION`)."""

    def to_dict(self) -> dict:
        """The JSON object of ``summary.json``, ``schema_version`` first."""
        fields = dataclasses.asdict(self)
        return {"schema_version": fields.pop("schema_version"), **fields}

    @property
    def monitor_share(self) -> Optional[float]:
        """``monitor_seconds`` over the sum of ``step_seconds`` (None when the trainer did not time its steps).
        With a bounded ``step_seconds`` window, a long run's share is over the steps kept."""
        if not self.step_seconds:
            return None
        return self.monitor_seconds / max(sum(self.step_seconds), 1e-12)


# name -> (the JSON types the field may hold, whether it may be null); bool is refused where an int is expected
_TYPES: Dict[str, tuple] = {
    "schema_version": ((int,), False), "final_step": ((int,), False), "first_step": ((int,), False),
    "losses": ((list,), False), "grad_norms": ((list,), False), "step_seconds": ((list,), True),
    "alerts": ((list,), False), "attribution": ((list,), False), "detectors": ((dict,), False),
    "diagnosis": ((dict,), True), "verdict": ((str,), False), "monitor_seconds": (_NUMBER, False),
    "monitor_breakdown": ((dict,), False), "mols_seconds": (_NUMBER, False),
    "mols_diagnostic_seconds": (_NUMBER, False), "mols_diagnostics": ((list,), False),
    "final_mols": ((dict,), False), "records_lost_steps": ((list,), False),
    "optimizer_steps_skipped": ((int,), False), "async_evaluation": ((dict,), False),
    "extensions": ((dict,), False), "trainer": ((dict,), False),
}


def run_verdict(alerts: Sequence[Alert], last_step: int | None, armed_from_step: int | None) -> str:
    """The run's verdict in one sentence: the first alert's diagnosis, or "No alerts fired." with whether the
    detectors were armed: a run that ended before its baseline-relative rules armed says so (only non-finite
    values and the level rules could alert in it), since its silence is no verdict on its health."""
    from megatron_mech.core.diagnosis import first_diagnosis

    first = first_diagnosis(alerts)
    if first is not None:
        where = f" in layer{'s' if len(first.layers) > 1 else ''} {', '.join(map(str, first.layers))}" \
            if first.layers else ""
        return f"First alert at step {first.step}: {first.label}{where}."
    if armed_from_step is None or last_step is None:
        return "No alerts fired."
    if last_step < armed_from_step:
        return (f"No alerts fired, and the detectors never armed: the run ended at step {last_step}, the first "
                f"baseline-relative rule arms at step {armed_from_step}; only non-finite values and the level rules "
                f"could alert before it.")
    return f"No alerts fired (detectors armed from step {armed_from_step}; the run ended at step {last_step})."


def build_run_summary(hook, *, alerts: Optional[Sequence] = None, step_seconds: Optional[Sequence[float]] = None,
                      trainer: Optional[Mapping[str, Any]] = None) -> RunSummary:
    """The summary of ``hook``'s run (a :class:`~megatron_mech.hook.MechHook`, read through its public
    properties; call it after the hook's ``close``, which reads back the last values and their alerts).
    ``alerts``: the run's alerts when the trainer has them from its records (``mech.jsonl`` holds those from
    before a resume too); default: those this process raised. ``step_seconds``: each step's wall time when the
    trainer times its steps. ``trainer``: the trainer's own fields (JSON values)."""
    from megatron_mech.core.attribution import alert_lines
    from megatron_mech.core.diagnosis import first_diagnosis

    alerts = list(hook.alerts if alerts is None else alerts)
    arming = hook.arming()
    final_step = arming["last_step"]
    losses = list(hook.losses)
    first = first_diagnosis(alerts)
    extension_summaries = {}
    for extension in hook.extensions:
        summary = extension.summary()
        if summary is not None:
            extension_summaries[extension.name] = summary
    return RunSummary(
        final_step=final_step, first_step=final_step - len(losses) + 1, losses=losses,
        grad_norms=list(hook.grad_norms),
        step_seconds=None if step_seconds is None else [float(s) for s in step_seconds],
        alerts=[a.to_dict() for a in alerts], attribution=alert_lines(alerts), detectors=arming,
        diagnosis=first.to_dict() if first is not None else None,
        verdict=run_verdict(alerts, arming["last_step"], arming["armed_from_step"]),
        monitor_seconds=float(hook.evaluation_seconds),
        monitor_breakdown=dict(hook.seconds_by_part),
        **hook.mols_report(),
        records_lost_steps=list(hook.lost_record_steps), optimizer_steps_skipped=hook.skipped_steps.total,
        async_evaluation=hook.async_report(), extensions=extension_summaries, trainer=dict(trainer or {}))


def write_run_summary(path, summary: RunSummary, indent: Optional[int] = None) -> bool:
    """Write ``summary`` to ``path`` atomically (``write_file_atomically``); returns whether it was written.
    Monitor output never kills a run: a failure (disk full, permissions, a symbolic link planted at either name
    after the start-up checks) is logged as an error naming the file, and the run ends normally, its checkpoints
    intact (the entry point's exit code then says its records are incomplete, ``records_incomplete``)."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_file_atomically(path, json.dumps(summary.to_dict(), indent=indent))
        return True
    except (OSError, ValueError) as exc:
        logger.error(f"[mech] ERROR: could not write {path}: {exc}; the run's checkpoints are not affected")
        return False


def read_run_summary(path) -> RunSummary:
    """The :class:`RunSummary` of the ``summary.json`` at ``path``. ``ValueError`` naming the file when it cannot
    be read (a FIFO or directory is refused, never waited on; one over :data:`MAX_SUMMARY_BYTES` is not read), is
    not a JSON object, has no ``schema_version`` or another than :data:`SCHEMA_VERSION`, lacks a field or has one
    this schema does not know, or a field's value is of the wrong type (naming the field)."""
    try:
        data = json.loads(read_small_file(path, MAX_SUMMARY_BYTES, "a run's summary").decode("utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read the run's summary ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: the run's summary is not a JSON object")
    version = data.get("schema_version")
    if version != SCHEMA_VERSION or isinstance(version, bool):
        found = "has no 'schema_version' (written before the schema was versioned)" if version is None else (
            f"has schema_version {version!r}")
        raise ValueError(f"{path}: the run's summary {found}; this version of megatron-mech reads schema_version "
                         f"{SCHEMA_VERSION} only")
    missing = [name for name in _TYPES if name not in data]
    unknown = sorted(set(data) - set(_TYPES))
    if missing or unknown:
        raise ValueError(f"{path}: the run's summary (schema_version {SCHEMA_VERSION}) "
                         + "; ".join(([f"lacks {', '.join(repr(m) for m in missing)}"] if missing else [])
                                     + ([f"has unknown {', '.join(repr(u) for u in unknown)}"] if unknown else [])))
    for name, (types, nullable) in _TYPES.items():
        value = data[name]
        if value is None and nullable:
            continue
        wrong_int = types == (int,) and not is_int(value)
        if wrong_int or isinstance(value, bool) or not isinstance(value, types):
            expected = " or ".join(t.__name__ for t in types) + (" or null" if nullable else "")
            raise ValueError(f"{path}: the run's summary field {name!r} must be {expected}, got "
                             f"{type(value).__name__}")
    return RunSummary(**data)
