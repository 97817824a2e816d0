"""The arming description: from which step the run's detectors can alert, said at the start (the start line, the
warnings of :func:`Arming.unarmed_settings`) and at the end (:meth:`Arming.summary`).

An :class:`Arming` is made on demand from values the hook's parts own (the detectors, the running monitors' names and
layer counts, the interval, the run's length) and holds nothing of its own: the rules a running monitor arms are
queried here only.
"""
from __future__ import annotations

from typing import List, Optional

from megatron_mech.core.detect import DetectorRegistry

__all__ = ["Arming"]

class Arming:
    """``registry``: the run's detectors; ``running``: the names of the running monitors; ``stage_counts``: layers
    per monitor over the model (empty before setup); ``interval``: ``--mech-interval``; ``train_steps``: the run's
    length (``None``: not known); ``rule_overrides``: the detector settings the run changed."""

    def __init__(self, registry: DetectorRegistry, *, running: set, stage_counts: dict, interval: int,
                 train_steps: Optional[int], rule_overrides: dict) -> None:
        self.registry, self.running, self.stage_counts = registry, running, stage_counts
        self.interval, self.train_steps, self.rule_overrides = interval, train_steps, rule_overrides

    # ------------------------------------------------------------------------------------ the armed rules
    def level_rules(self) -> list:
        """The level rules (:meth:`DetectorRegistry.level_rules`) a running monitor brought: armed from the first
        evaluation."""
        return self.registry.level_rules(self.running)

    def trend_rules(self) -> list:
        """``[(rule, armed-from step)]``: the layer trends (:meth:`DetectorRegistry.trend_rules`) the running
        monitors brought, each armed after its own warm-up and one window."""
        return [(rule, (rule.trend_warmup + rule.trend_window) * self.interval)
                for rule in self.registry.trend_rules(self.running)]

    def update_jump(self) -> Optional[int]:
        """The step the update-ratio jump (``DetectorRegistry.update_jump``) first judges an evaluation: after its
        warm-up and one full window; None when it is off or the monitor that brings it does not run."""
        jump = self.registry.update_jump
        if jump is None or self.registry.update_jump_source not in self.running:
            return None
        return (jump.warmup + jump.window + 1) * self.interval

    def earliest_rule(self) -> tuple:
        """The detector settings of the rule that can alert first on a baseline-relative change, and the number of
        evaluations it needs before that alert (:meth:`DetectorRegistry.earliest_alert`), among the rules of the
        families this run watches (the symptoms always; attention and router where the model has such layers, once
        set up)."""
        watched = None if not self.stage_counts else {"symptom", *(name for name, layers in
                                                                  self.stage_counts.items() if layers)}
        return self.registry.earliest_alert(watched)

    @property
    def armed_from_step(self) -> int:
        """The earliest step at which a baseline-relative alert can fire (counted from step 1, across resumes)."""
        return self.earliest_rule()[1] * self.interval

    # ------------------------------------------------------------------------------------ in words
    def summary(self, last_step: int) -> dict:
        """For the run's summary and end-of-run line: :attr:`armed_from_step`, the last step taken (across
        resumes), whether the run reached the armed-from step, and a sentence saying so (a run that ended before
        it could alert on non-finite values only)."""
        armed_from = self.armed_from_step
        armed = last_step >= armed_from
        levels, trends = self.level_rules(), self.trend_rules()
        reached = [step for _, step in trends if step <= last_step]
        others = (["the level rules"] if levels else []) + ([f"the layer trend (from step {min(reached)})"] if reached
                                                            else [])
        note = (f"run ended at step {last_step}; detectors armed from step {armed_from}" if armed else
                f"run ended at step {last_step}, before the detectors were armed (step {armed_from}): only "
                f"non-finite values{''.join(' and ' + other for other in others)} could alert")
        arming = {"armed_from_step": armed_from, "last_step": last_step, "armed": armed, "note": note,
                  "rule_overrides": self.rule_overrides}  # the report rebuilds the rules from it
        if levels:  # armed from the first evaluation, whatever the baseline-relative rules' warm-up
            arming["note"] += f"; level rules ({_describe_levels(levels)}) armed from step {self.interval}"
            arming["level_rules"] = {"armed_from_step": self.interval,
                                     "rules": [_describe_levels([r]) for r in levels]}
        if trends:
            arming["layer_trends"] = [{"rule": _describe_trend(rule), "armed_from_step": step} for rule, step in trends]
        jump = self.update_jump()
        if jump is not None:
            arming["update_ratio_jump"] = {"armed_from_step": jump, "level": self.registry.update_jump.level}
        return arming

    def start_line(self, monitored: list, weights: str) -> str:
        """The one line setup logs: what is monitored (``monitored``: each running monitor in words; ``weights``:
        which weights they read), how often, and from which step the detectors can alert."""
        first, _ = self.earliest_rule()
        levels = self.level_rules()
        level_part = (f"; level rules armed from the first evaluation (step {self.interval}): "
                      f"{_describe_levels(levels)}" if levels else "")
        level_part += "".join(f"; layer trend armed from step {step}: {_describe_trend(rule)}"
                              for rule, step in self.trend_rules())
        jump = self.update_jump()
        if jump is not None:
            level_part += (f"; update-ratio jump armed from step {jump}: every layer's update ratio, in median, "
                           f">= {self.registry.update_jump.level:.3g} log units above its own last "
                           f"{self.registry.update_jump.window} evaluations")
        reading = f", reading {weights}" if monitored and weights else ""
        return (f"[mech] monitors on: {', '.join(monitored) or 'none (loss and grad norm only)'}, every "
                f"{_count(self.interval, 'step')}{reading}; detectors armed from step "
                f"{self.armed_from_step} (warm-up "
                f"{first.warmup} + baseline {first.baseline} + persistence {first.persistence} evaluations)"
                f"{level_part}")

    def unarmed_settings(self) -> List[str]:
        """Why this configuration can alert on nothing but non-finite values in a run of ``train_steps`` steps, one
        message per reason ([] when it can, or when the run's length is not known): an interval longer than the run
        (no evaluation at all), or fewer evaluations than the detectors need before their first baseline-relative
        alert. The count is over the whole run, from step 1: a resumed run's detectors carry their progress
        over."""
        if not self.train_steps:
            return []
        steps, interval = int(self.train_steps), self.interval
        if interval > steps:
            return [f"--mech-interval {interval} (mech.monitors.interval) is longer than the run's {steps} training "
                    f"steps: nothing will be evaluated (no monitor record, no baseline-relative alert; only a "
                    f"non-finite loss or grad norm can alert). Use an interval of at most {steps}"]
        evaluations = steps // interval
        first, needed = self.earliest_rule()
        if evaluations >= needed:
            return []
        levels = self.level_rules()
        can_alert = ("Only non-finite values can alert" if not levels else
                     f"Only non-finite values and the level rules ({_describe_levels(levels)}, armed from the first "
                     f"evaluation) can alert")
        trends = [armed for _, armed in self.trend_rules() if armed <= steps]
        if trends:
            can_alert += f", and the layer trend from step {min(trends)}"
        return [f"the detectors cannot reach a baseline in this run: its {steps} training steps at --mech-interval "
                f"{interval} make {evaluations} evaluation{'s' if evaluations != 1 else ''}, and the earliest "
                f"baseline-relative alert needs {needed}: {first.warmup} warm-up ({_setting('warmup')}) + "
                f"{first.baseline} baseline ({_setting('baseline')}) + {first.persistence} out-of-band "
                f"({_setting('persistence')}). {can_alert}; lower them or the interval (--mech-interval, "
                f"mech.monitors.interval)"]


def _setting(name: str) -> str:
    """A detector setting as both kinds of run spell it: its flag (Megatron) and its ``"mech"`` key (DeepSpeed)."""
    from megatron_mech.config import DetectorOverrides
    from megatron_mech.core.option_fields import field_flag, field_key

    return f"{field_flag(DetectorOverrides, name)}, mech.detector.{field_key(DetectorOverrides, name)}"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _describe_levels(rules) -> str:
    """``symptom/max_attn_logit/layer* > 100, ...``: level rules as a reader sees them."""
    return ", ".join(f"{rule.pattern} {'>' if rule.direction == 'up' else '<'} {rule.level:g}" for rule in rules)


def _describe_trend(rule) -> str:
    """``attn/*/head*/delta2_entropy: a layer's median fall >= 1.5 log units over 10 evaluations``."""
    way = "rise" if rule.direction == "up" else "fall"
    return (f"{rule.pattern}: a layer's median {way} >= {rule.layer_trend:g} log units over {rule.trend_window} "
            f"evaluations")
