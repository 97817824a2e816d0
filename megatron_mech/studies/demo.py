"""``megatron-mech demo``: a clean run and fault runs of the small MoE GPT, the alert timeline, the lead time.

Every run is our entry point under ``torchrun`` with ``--mech-on-alert checkpoint``. What the demo reports about a
run comes from its records: the alerts from ``mech.jsonl`` (the run's one record of alerts) and the per-step loss
and grad norm from ``summary.json``'s ``losses`` and ``grad_norms``, indexed by step (``first_step`` is the step of
``losses[0]``); the incumbents' grad-norm rules judge every step's grad norm, as on a trainer.

Each fault's outcome is stated apart from the monitors: the router act's routing collapse from the routers' own
decisions (:mod:`megatron_mech.studies.router_outcome`), the attention act's maximum attention logit against the
QK-clip level and the max-logit explosion criterion (:mod:`megatron_mech.studies.outcomes`) and its loss gap to the
clean run. On every run the incumbent alarms (:mod:`megatron_mech.studies.incumbents`) are applied to the run's own
records from the fault's onset on (an alarm before the onset is listed on the clean run, where it fires too), and
each act sets the first alert of its own monitor family (attention for the attention act, router for the router act)
against them. The report's title states, per act, who warned first and by how many steps, computed from the runs.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from megatron_mech.records.safe_files import write_file_atomically

__all__ = ["DEMO_ATTENTION_FLAGS", "DEMO_FAULTS", "DIVERGENCE_MARGIN", "ActScore", "attention_outcome_line",
           "clean_rings", "collapse_line", "counted_firings", "demo_commands", "demo_fault_flags", "demo_length",
           "demo_report", "false_on_clean", "first_counted", "incumbents_from", "incumbents_line", "load_demo_run",
           "not_counted_text", "run_demo", "score_act", "step_losses", "steps_ahead"]

# The demo's attention fault: the lead-time study's precision fault (``FAULT_FLAGS["attention"]``, γ = 0.1 in layer
# 1 from step 300) made stronger and, with the CLI's ``--fault-start`` of 260, earlier, so that within the demo's 500
# steps the max attention logit explodes by the attention outcome's own criterion
# (:mod:`megatron_mech.studies.outcomes`). From step 300 it did not, or with one record to spare: the logit climbs
# at a pace set by the decaying learning rate (Adam), not by γ. γ ramps in over 100 steps: a fault that develops,
# as a precision fault does when the activations it rounds grow, instead of a switch the grad norm shows at once
# (at full strength from the start the grad norm jumped in the first record and OLMo-core's spike rule fired 15–20
# steps after the onset). Chosen on the tuning seeds (benchmarks/results/demo_attention_tuning.md).
DEMO_ATTENTION_FLAGS = ["--mech-fault", "attention", "--mech-fault-strength", "0.3", "--mech-fault-layers", "1",
                        "--mech-fault-ramp", "100"]
DIVERGENCE_MARGIN = 0.2  # nats: the 20-step moving-average loss stays this far above the clean run to the end
# The monitor family whose alert is the act's own: the fault's mechanism, which the demo expects named first.
OWN_FAMILY = {"attention": "attention", "router": "router"}


def _fresh_summary(run_dir):
    """The :class:`~megatron_mech.records.run_summary.RunSummary` of a fresh run (its series start at step 1); a
    resumed run is refused."""
    from megatron_mech.records.run_summary import read_run_summary

    summary = read_run_summary(Path(run_dir) / "summary.json")
    if summary.first_step != 1:
        raise ValueError(f"{run_dir}: the run resumed at step {summary.first_step}; the demo needs fresh runs")
    return summary


def step_losses(run_dir) -> list:
    """The loss of every step of a fresh run, ``[loss of step 1, loss of step 2, ...]`` (from ``summary.json``)."""
    return _fresh_summary(run_dir).losses


def _progress_line(line: str) -> bool:
    return line.startswith(("[train]", "[mech]", "[fault]", "[eval]"))


def demo_length(args: argparse.Namespace) -> tuple:
    """``(steps, fault start)`` of every demo run: 120 and 60 with ``--quick``, else the flags'."""
    return (120, 60) if args.quick else (args.steps, args.fault_start)


def demo_fault_flags(name: str, quick: bool = False) -> list:
    """The ``--mech-fault*`` flags of the demo's fault run ``name``: :data:`DEMO_ATTENTION_FLAGS` for the attention
    act, the fault studies' flags (``FAULT_FLAGS``) for the others. ``quick``: the attention fault at full strength
    from its start (the quick demo's 60 steps after the onset are too few for the ramp; it checks the pipeline)."""
    from megatron_mech.studies.leadtime import FAULT_FLAGS

    flags = list(DEMO_ATTENTION_FLAGS) if name == "attention" else list(FAULT_FLAGS[name])
    if quick and name == "attention":
        ramp = flags.index("--mech-fault-ramp")
        del flags[ramp:ramp + 2]
    return flags


def demo_commands(args: argparse.Namespace) -> dict:
    """The torchrun command of each demo run (``clean`` first, then the faults), by run name. The preset's LR
    warm-up is shortened to fit a short demo (:func:`megatron_mech.trainers.megatron_core.presets.fit_lr_warmup`)."""
    from megatron_mech.studies.leadtime import LEAD_MODEL
    from megatron_mech.studies.pretrain_gpt_fault import ENTRY_MODULE
    from megatron_mech.trainers.megatron_core.launch import torchrun_prefix
    from megatron_mech.trainers.megatron_core.presets import fit_lr_warmup

    steps, start = demo_length(args)
    faults = ["attention"] if args.quick else list(dict.fromkeys(args.faults))
    detector = (["--mech-detector-warmup", "4", "--mech-detector-baseline", "6"] if args.quick else [])
    commands = {}
    for name in ["clean", *faults]:
        fault = [*demo_fault_flags(name, args.quick), "--mech-fault-start", str(start)] if name != "clean" else []
        run_dir = Path(args.out) / name
        commands[name] = [*torchrun_prefix(2), "-m", ENTRY_MODULE,
                          *fit_lr_warmup(LEAD_MODEL, steps), "--seed", str(args.seed), "--train-iters", str(steps),
                          "--save", str(run_dir), "--tensorboard-dir", str(run_dir / "tb"),
                          "--mech-on-alert", "checkpoint", "--overwrite-run", *detector, *fault,  # it owns its folders
                          "--mech-record-routing", str(run_dir)]
    return commands


DEMO_FAULTS = {
    "attention": ("attention-precision fault", "the biased bf16-rounding mechanism of FlashAttention's backward "
                  "injected into layer {layers}, {gamma}"),
    "router": ("router fault (a massive activation at the routers)", "a vector shared by every token added to each "
               "MoE router's input, aligned so that it adds β to the logits of half of the experts, β growing from 0 "
               "to {strength} over {ramp} steps (the experts still get the true tokens; no load-balancing loss holds "
               "the routing)"),
}
"""The demo's fault runs: ``(title, what was injected)``, formatted with the fault's ``--mech-fault-*`` values
(``{gamma}``: the attention fault's γ, ramped or at once)."""


def _fault_text(name: str, quick: bool = False) -> tuple:
    values, key = {}, None
    for item in demo_fault_flags(name, quick):  # a flag's values (``--mech-fault-layers 1 2``: "1 2") by its name
        if item.startswith("--"):
            key = item[len("--mech-fault-"):]
            values[key] = ""
        else:
            values[key] = f"{values[key]} {item}".strip()
    values["gamma"] = (f"γ growing from 0 to {values.get('strength')} over {values['ramp']} steps" if "ramp" in values
                       else f"γ = {values.get('strength')}")
    return tuple(text.format(**values) for text in DEMO_FAULTS[name])


def collapse_line(run_dir) -> str:
    """What the routing record says: the step routing collapsed (by
    :func:`~megatron_mech.studies.router_outcome.find_collapse`), or that it did not."""
    from megatron_mech.studies.router_outcome import STARVED_HOLD, STARVED_SHARE, find_collapse, read_routing_counts

    collapse = find_collapse(read_routing_counts(run_dir))
    level = (f"an expert gets < {STARVED_SHARE:.0%} of its layer's top-k assignments for {STARVED_HOLD} "
             f"consecutive steps, counted on the routers' own decisions, apart from the monitors")
    if collapse is None:
        return f"routing did not collapse within the run ({level})"
    return (f"routing collapsed at step {collapse.step} (known at step {collapse.step + STARVED_HOLD - 1}): expert "
            f"{collapse.expert} of layer {collapse.layer} starved ({level})")


def load_demo_run(run_dir, seed: int) -> dict:
    """One finished demo run as the report reads it: per-step losses and grad norms (its ``summary.json``;
    ``grad_norms`` None when no step has one, :func:`~megatron_mech.studies.incumbents.per_step_grad_norms`),
    alerts and ``mech.jsonl`` records."""
    from megatron_mech.records.sinks import read_alerts, read_jsonl
    from megatron_mech.studies.incumbents import per_step_grad_norms

    run_dir = Path(run_dir)
    summary = _fresh_summary(run_dir)
    return {"losses": summary.losses, "grad_norms": per_step_grad_norms(summary.grad_norms),
            "alerts": read_alerts(run_dir / "mech.jsonl"), "records": read_jsonl(run_dir / "mech.jsonl"), "seed": seed}


def incumbents_from(run: dict, from_step: int = 1) -> dict:
    """First firing (or None) of each incumbent rule on a demo run (:mod:`megatron_mech.studies.incumbents`), at or
    after ``from_step``."""
    from megatron_mech.studies.incumbents import microbatches_per_rank, run_incumbent_firings
    from megatron_mech.studies.leadtime import LEAD_MODEL

    return run_incumbent_firings(run["records"], run["losses"], microbatches=microbatches_per_rank(LEAD_MODEL, 2),
                                 grad_norms=run.get("grad_norms"), from_step=from_step)


def clean_rings(clean: dict, rule: str, start: int) -> int:
    """At how many steps incumbent ``rule`` fired on the clean run from ``start`` to the end (a level rule fires at
    every step it stays above its level): what a rule that is not counted (:func:`false_on_clean`) would have paged
    a person with on a run without the fault."""
    from megatron_mech.studies.incumbents import firing_steps

    return len(firing_steps(lambda step: incumbents_from(clean, step), rule, start))


def _series_text(runs: dict) -> str:
    """What the incumbent rules read on the demo's runs: every step's loss, the grad norm as
    :func:`~megatron_mech.studies.incumbents.grad_norm_reading` says, the recorded max logit."""
    from megatron_mech.studies.incumbents import grad_norm_reading

    per_step = all(run.get("grad_norms") is not None for run in runs.values())
    return f"per-step loss, {grad_norm_reading(per_step)}, and recorded max logit"


def _fired_text(firings: dict) -> str:
    fired = sorted((step, rule) for rule, step in firings.items() if step is not None)
    silent = [rule for rule, step in firings.items() if step is None]
    parts = [f"{rule} at {step}" for step, rule in fired] + ([f"silent: {', '.join(silent)}"] if silent else [])
    return "; ".join(parts)


def not_counted_text(not_counted: dict, rings: dict) -> str:
    """A report's cell for the rules not counted (``{rule: the clean run's first firing}``, :func:`false_on_clean`)
    with how many times each rang on the clean run (``{rule: count}``, :func:`clean_rings`); "–" for none."""
    return ", ".join(f"{rule} (from {step}, at {_steps(rings[rule])})" for rule, step in not_counted.items()) or "–"


def _steps(n: int) -> str:
    return f"{n} step" if n == 1 else f"{n} steps"


def false_on_clean(firings: dict, clean_firings: dict | None) -> dict:
    """The rules that fired on the fault run and also on the clean run, both from the fault's onset to the end:
    ``{rule: the clean run's first firing}``. Such a rule's firing is not counted as a warning of the fault: it rings
    without it, and a person paged by it could not tell the two apart. It is the standard the monitors' own alerts
    are held to (none on a clean run), and like it, it watches the whole clean run: on a long run a rule that rings
    once, late, loses its count on the fault run however early it fired there. Counting a rule unless the clean run
    rang *as early* would credit a rule that rings every few steps with a warning about half the time on runs
    without any fault (``benchmarks/incumbent_placebo.py``)."""
    if not clean_firings:
        return {}
    return {rule: clean_firings[rule] for rule, step in firings.items()
            if step is not None and clean_firings.get(rule) is not None}


def counted_firings(firings: dict, clean_firings: dict | None = None) -> dict:
    """``{rule: step}`` of the incumbent firings (``{rule: first step or None}``, see :func:`incumbents_from`) that
    count as warnings: every rule that fired, less those :func:`false_on_clean` names when the clean run's firings
    from the same step are given."""
    skip = false_on_clean(firings, clean_firings)
    return {rule: step for rule, step in firings.items() if step is not None and rule not in skip}


def first_counted(counted: dict):
    """``(step, rule)`` of the earliest of ``counted`` (``{rule: step}``, e.g. :func:`counted_firings`), or None."""
    return min((step, rule) for rule, step in counted.items()) if counted else None


def _first_incumbent(firings: dict, clean_firings: dict | None = None):
    """``(step, rule)`` of the first counted incumbent alarm (:func:`counted_firings`), or None."""
    return first_counted(counted_firings(firings, clean_firings))


@dataclass(frozen=True)
class ActScore:
    """One fault act of the demo scored against its clean run, from the steps both runs recorded."""

    act: str
    """The fault run's name (``attention``, ``router``)."""
    who: str
    """The family whose alert is the act's own (``OWN_FAMILY``), or ``monitor`` (attention or router) for others."""
    firsts: dict
    """``{family: first alert step or None}`` for ``attention``, ``router`` and ``symptom``."""
    first: Optional[int]
    """The act's own family's first alert (for ``monitor``, the earlier of attention and router)."""
    alert: Any
    """The :class:`~megatron_mech.core.detect.Alert` at ``first`` in the act's own family, or None."""
    divergence: Optional[int]
    """The first step of the loss divergence against the clean run, or None."""
    firings: dict
    """Each incumbent rule's first firing at or after the onset on the fault run (``{rule: step or None}``)."""
    not_counted: dict
    """The rules among ``firings`` not counted as they fired on the clean run too (:func:`false_on_clean`):
    ``{rule: the clean run's first firing}``."""
    clean_rings: dict
    """How many times each rule of ``not_counted`` fired on the clean run from the onset (:func:`clean_rings`)."""
    first_incumbent: Optional[tuple]
    """``(step, rule)`` of the first counted incumbent alarm, or None."""

    def headline(self, title: str) -> str:
        """The act in the report's title (:func:`headline`)."""
        return headline(title, self.first, self.divergence, self.first_incumbent)

    @property
    def lead(self) -> Optional[int]:
        """Steps ahead of the nearest of the loss divergence and the first counted incumbent (:func:`steps_ahead`)."""
        return steps_ahead(self.first, self.divergence, self.first_incumbent)

    def verdict_line(self) -> str:
        """The act's :func:`verdict`."""
        return verdict(self.first, self.divergence, self.first_incumbent, self.who)

    def incumbents_line(self, start: int) -> str:
        """The act's :func:`incumbents_line` (fault from ``start``), from the firings already scored."""
        return _incumbents_text(self.firings, self.first_incumbent, self.not_counted, self.first, start, self.who,
                                self.clean_rings)


def score_act(runs: dict, act: str, start: int, margin: float = DIVERGENCE_MARGIN,
              own: Optional[str] = None) -> ActScore:
    """Score the fault run ``runs[act]`` against ``runs["clean"]`` (both as :func:`load_demo_run` reads them) for a
    fault from step ``start``: its own family's first alert, the loss divergence (``margin`` nats over the clean run
    to the end), and the incumbent alarms from the onset, a rule that rang on the clean run too not counted.
    ``own``: the fault's own family (default: the demo's, :data:`OWN_FAMILY`; none known: attention or router)."""
    from megatron_mech.studies.leadtime import divergence_step, first_alert

    run, clean = runs[act], runs["clean"]
    firsts = {f: first_alert(run["alerts"], f) for f in ("attention", "router", "symptom")}
    own = own or OWN_FAMILY.get(act)
    first = firsts[own] if own else min((s for s in (firsts["attention"], firsts["router"]) if s), default=None)
    alert = next((a for a in run["alerts"] if a.step == first and a.family in ((own,) if own else
                                                                              ("attention", "router"))), None)
    firings, clean_firings = incumbents_from(run, start), incumbents_from(clean, start)
    not_counted = false_on_clean(firings, clean_firings)
    return ActScore(act=act, who=own or "monitor", firsts=firsts, first=first, alert=alert,
                    divergence=divergence_step(run["losses"], clean["losses"], margin), firings=firings,
                    not_counted=not_counted,
                    clean_rings={rule: clean_rings(clean, rule, start) for rule in not_counted},
                    first_incumbent=_first_incumbent(firings, clean_firings))


def verdict(first_ours, divergence, first_incumbent, who: str = "monitor") -> str:
    """One fault run's outcome in a line, computed from the steps (never a fixed claim): ``early`` when the
    monitors alerted before the loss diverged (or it never did) and before every incumbent alarm; ``tie`` when at
    the step of one of them and before none; ``late`` when they alerted after either; ``missed`` when they did not
    alert. ``first_incumbent``: ``(step, rule)`` or None;
    ``who``: the alert's family as the line names it."""
    if not first_ours:
        return f"**missed**: no {who} alert" + ("" if first_incumbent is None else
                                                 f"; first incumbent alarm: {first_incumbent[1]} at "
                                                 f"{first_incumbent[0]}")
    if divergence is None:
        loss = "the loss did not diverge within the run"
    elif first_ours < divergence:
        loss = f"{divergence - first_ours} steps before the loss diverged"
    else:
        loss = (f"{first_ours - divergence} steps after the loss diverged" if first_ours > divergence else
                "at the step the loss diverged")
    if first_incumbent is None:
        incumbents = "no incumbent alarm fired"
    else:
        step, rule = first_incumbent
        incumbents = (f"{step - first_ours} steps before the first incumbent alarm ({rule})" if first_ours < step
                      else f"{first_ours - step} steps after the first incumbent alarm ({rule})" if first_ours > step
                      else f"at the same step as the first incumbent alarm ({rule})")
    ahead = steps_ahead(first_ours, divergence, first_incumbent)  # None: no rival fired
    label = "early" if ahead is None or ahead > 0 else "tie" if ahead == 0 else "late"
    return f"**{label}**: first {who} alert at {first_ours}, {loss}, {incumbents}"


def steps_ahead(first_ours, divergence, first_incumbent) -> Optional[int]:
    """Steps from our first alert to the nearest of the loss divergence and the first counted incumbent alarm
    (``(step, rule)``): positive when ours came first, 0 in a tie; None when we did not alert or neither happened."""
    rivals = [step for step in (divergence, first_incumbent[0] if first_incumbent else None) if step]
    return min(rivals) - first_ours if first_ours and rivals else None


def headline(title: str, first_ours, divergence, first_incumbent) -> str:
    """One act in the report's title, from the steps: whether its own family warned first (before the loss and
    every incumbent alarm) and by how many steps over the nearest of them (:func:`steps_ahead`)."""
    if not first_ours:
        return f"{title} missed"
    ahead = steps_ahead(first_ours, divergence, first_incumbent)
    if ahead is None:
        return f"{title} caught at step {first_ours}, before any counted alarm (the loss did not diverge)"
    if ahead > 0:
        return f"{title} caught first, {ahead} steps ahead"
    return f"{title} caught late, {-ahead} steps behind" if ahead < 0 else f"{title} caught in a tie"


def incumbents_line(run: dict, first_ours, from_step: int = 1, who: str = "monitor",
                    clean_firings: dict | None = None) -> str:
    """Our first alert against the alarms users already have (each incumbent rule's first firing at or after
    ``from_step``), on one run; with ``clean_firings`` (the clean run's from the same step), the rules that fired on
    the clean run too are named and not counted (:func:`false_on_clean`)."""
    firings = incumbents_from(run, from_step)
    return _incumbents_text(firings, _first_incumbent(firings, clean_firings), false_on_clean(firings, clean_firings),
                            first_ours, from_step, who)


def _incumbents_text(firings: dict, first, skipped: dict, first_ours, from_step: int, who: str,
                     rings: dict | None = None) -> str:
    """:func:`incumbents_line` from the firings already found: ``first`` the first counted one (``(step, rule)`` or
    None), ``skipped`` the rules not counted (``{rule: the clean run's first firing}``), ``rings`` how many times
    each of them fired on the clean run (when known)."""
    since = "" if from_step <= 1 else f" from the fault's onset (step {from_step})"
    ours = f"our first {who} alert: {first_ours if first_ours else 'none'}"
    if skipped:
        ours += "; not counted, as they fired on the clean run too: " + ", ".join(
            f"{rule} (here {firings[rule]}; on the clean run from the onset: first {step}"
            + (f", at {_steps(rings[rule])})" if rings else ")")
            for rule, step in skipped.items())
    if first is None:
        return f"{ours}; no incumbent alarm fired{since} ({_fired_text(firings)})"
    step, rule = first
    verdict = ("" if not first_ours else f" — ours {step - first_ours} steps before the first of them" if
               first_ours < step else f" — ours {first_ours - step} steps after the first of them" if
               first_ours > step else " — ours at the same step as the first of them")
    return f"{ours}; incumbent alarms on the same run{since}: {_fired_text(firings)}{verdict}"


def attention_outcome_line(faulty: dict, clean: dict, start: int) -> str:
    """What the attention fault did, measured apart from the monitors: the maximum attention logit against the
    QK-clip level and the max-logit explosion criterion (:mod:`megatron_mech.studies.outcomes`), and the loss gap
    to the clean run."""
    from megatron_mech.monitors.max_logit import MAX_LOGIT_METRIC
    from megatron_mech.studies.incumbents import QK_CLIP_THRESHOLD, metric_series, qk_clip_step
    from megatron_mech.studies.leadtime import moving_average
    from megatron_mech.studies.outcomes import LOGIT_EXPLOSION_HOLD, LOGIT_EXPLOSION_LEVEL, max_logit_explosion_step

    steps, values = metric_series(faulty["records"], MAX_LOGIT_METRIC)
    if not steps:
        return f"attention outcome: not measured (no {MAX_LOGIT_METRIC} in the run's records)"
    before = [v for s, v in zip(steps, values) if s < start]
    after = [(v, s) for s, v in zip(steps, values) if s >= start] or [(values[-1], steps[-1])]
    peak, peak_step = max(after)
    crossed = qk_clip_step(values, steps)
    exploded = max_logit_explosion_step(steps, values, LOGIT_EXPLOSION_LEVEL, LOGIT_EXPLOSION_HOLD)
    held_at_end = 0
    for value in reversed(values):
        if value < LOGIT_EXPLOSION_LEVEL:
            break
        held_at_end += 1
    explosion = (f"from step {exploded}" if exploded else
                 f"not met within the run (≥ {LOGIT_EXPLOSION_LEVEL:g} in its last {held_at_end} records)"
                 if held_at_end else "not met within the run")
    clip = (f"above the QK-clip level ({QK_CLIP_THRESHOLD:g}) from step {crossed}" if crossed else
            f"never above the QK-clip level ({QK_CLIP_THRESHOLD:g})")
    gaps = [f - c for f, c in zip(moving_average(faulty["losses"]), moving_average(clean["losses"]))]
    after_onset = [(gap, i + 1) for i, gap in enumerate(gaps) if i + 1 >= start]
    if after_onset:
        worst_gap, worst_step = max(after_onset)
        loss = f"{gaps[-1]:+.3f} nats at the end (largest after onset {worst_gap:+.3f}, step {worst_step})"
    else:
        loss = "not measured (the runs end before the fault)"
    return (f"attention outcome (the max attention logit and the loss, measured apart from the monitors): max "
            f"logit {before[-1] if before else values[0]:.3g} before the fault → {peak:.3g} at step {peak_step}; "
            f"{clip}; max-logit explosion (≥ {LOGIT_EXPLOSION_LEVEL:g} for {LOGIT_EXPLOSION_HOLD} consecutive "
            f"records): {explosion}; 20-step moving-average loss gap to the clean run: {loss}")


def demo_report(out, names, *, seed: int, steps: int, start: int, plots: bool = True, quick: bool = False) -> str:
    """The demo's report (``demo.md``'s text) from the finished runs ``out/<name>`` (``clean`` and the faults, in
    ``names``' order); with ``plots``, each fault's plot is drawn into ``out`` too. ``quick``: the runs are the
    quick demo's (its attention fault is not ramped)."""
    from megatron_mech.core.attribution import alert_lines
    from megatron_mech.studies.leadtime import plot_fault

    out = Path(out)
    runs = {name: load_demo_run(out / name, seed) for name in names}
    faults = [name for name in names if name != "clean"]
    clean = runs["clean"]
    clean_firings = incumbents_from(clean)
    scores = {name: score_act(runs, name, start) for name in faults}
    heads = [score.headline(_fault_text(name, quick)[0]) for name, score in scores.items()]
    lines = [f"# megatron-mech demo (seed {seed}): " + ("; ".join(heads) if heads else "a clean run"), "",
             f"Runs of the small MoE GPT (seed {seed}, {steps} steps), identical except for one injected fault "
             f"from step {start}; the incumbent alarms read each run's own {_series_text(runs)}. An incumbent "
             f"alarm that also rings on the clean run after the onset is named but not counted. How the runs are "
             f"scored: docs/guides/entry-point.md, \"How the demo counts\".", "",
             f"- clean run: {len(clean['alerts'])} alerts (false alarms); incumbent alarms on it, from step 1: "
             + ("none fired" if all(step is None for step in clean_firings.values()) else _fired_text(clean_firings))]
    lines += ["", "## Verdict", ""]
    lines += [f"- {_fault_text(name, quick)[0]}: {sc.verdict_line()}"
              for name, sc in scores.items()]
    for name in faults:
        faulty = runs[name]
        divergence, firsts, first = scores[name].divergence, scores[name].firsts, scores[name].first
        plot = "demo.png" if name == "attention" else f"demo_{name}.png"
        if plots:
            plot_fault(out / plot, name, clean, faulty, start, divergence, firsts)
        title, what = _fault_text(name, quick)
        lines += ["", f"## {title}", "", f"Fault: {what}, from step {start}.", "",
                  f"- first attention alert: {firsts['attention'] or 'none'}; first router alert: "
                  f"{firsts['router'] or 'none'}; first symptom (loss/grad-norm) alert — what you have today: "
                  f"{firsts['symptom'] or 'none'}; loss divergence: {divergence or 'not within the run'}"]
        if name == "router":
            lines.append(f"- {collapse_line(out / name)}")
        if name == "attention":
            lines.append(f"- {attention_outcome_line(faulty, clean, start)}")
        lines.append(f"- {scores[name].incumbents_line(start)}")
        if first and firsts["symptom"] and first < firsts["symptom"]:
            lines.append(f"- **the monitors fired {firsts['symptom'] - first} steps before the loss/grad-norm "
                         f"alarm**")
        elif first and firsts["symptom"]:
            lines.append(f"- the monitors fired {first - firsts['symptom']} steps after the loss/grad-norm alarm"
                         if first > firsts["symptom"] else "- the monitors fired with the loss/grad-norm alarm")
        elif first:
            lines.append("- **the monitors fired; the loss/grad-norm alarm never did**")
        if divergence and first and first <= divergence:
            lines.append(f"- **lead time of the monitors: {divergence - first} steps** "
                         f"({100 * (first - start) / max(1, divergence - start):.0f}% of the way from fault onset "
                         f"to divergence)")
        elif divergence and first:
            lines.append(f"- **no lead: the monitors alerted {first - divergence} steps after the loss diverged**")
        lines += ["", "Alert timeline:", ""]
        lines += [f"- {line}" for line in alert_lines(faulty["alerts"])] or ["- no alerts"]
        lines += ["", f"![monitors vs loss]({plot})"]
    lines += ["", "Per-run reports: " + ", ".join(f"`{n}/report.md`" for n in runs) + ". Each fault run saved a "
              "checkpoint at its first alert (`<run>/first_alert.json` names it)."]
    return "\n".join(lines) + "\n"


def run_demo(args: argparse.Namespace) -> int:
    """``megatron-mech demo``: see the module docstring."""
    import os

    from megatron_mech.records.report import run_report
    from megatron_mech.studies.pretrain_gpt_fault import check_flags
    from megatron_mech.trainers.megatron_core.launch import run_training

    steps, start = demo_length(args)
    commands = demo_commands(args)
    for name, cmd in commands.items():  # every run's flags, before the first one starts
        error = check_flags(cmd, 2)
        if error:
            print(f"megatron-mech demo: error: the {name} run's flags: {error}", file=sys.stderr)
            return 2
    out = Path(args.out)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    for name, cmd in commands.items():
        run_dir = out / name
        what = f", {_fault_text(name, args.quick)[0]} from step {start}" if name != "clean" else ""
        print(f"== {name} run ({steps} steps{what}) ==", flush=True)
        code, _ = run_training(cmd, env, show=_progress_line, prefix=f"[{name}] ")
        if code:
            print(f"error: the {name} run failed", file=sys.stderr)
            return 1
        run_report(argparse.Namespace(run_dir=str(run_dir), out=None, metrics=None))

    text = demo_report(out, list(commands), seed=args.seed, steps=steps, start=start, quick=args.quick)
    write_file_atomically(out / "demo.md", text)  # never through a link
    print(text, end="")
    print(f"\nreport: {out / 'demo.md'}\nplots:  " + ", ".join(str(p) for p in sorted(out.glob("demo*.png"))))
    return 0
