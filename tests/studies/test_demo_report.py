"""The demo's report (megatron_mech.studies.demo.demo_report) built from small hand-written run folders whose
answers are known by construction: the attention act's outcome, measured apart from the monitors, and the line
that sets our first alert against the incumbent alarms on the same run."""
import json

import pytest

from run_summaries import write_summary_file
from megatron_mech.studies.demo import demo_report, headline, incumbents_line, load_demo_run, verdict

STEPS, START = 200, 100
RECORD_EVERY = 5


def _write_run(run_dir, losses, max_logit, grad_norm, alerts=(), per_step_grad_norms=False):
    """A finished run: ``summary.json`` with every step's loss (and grad norm, with ``per_step_grad_norms``; without,
    a trainer that gave none), ``mech.jsonl`` with a record every 5 steps."""
    run_dir.mkdir(parents=True)
    steps = range(1, len(losses) + 1)
    write_summary_file(run_dir / "summary.json", first_step=1, final_step=len(losses), losses=losses,
                       grad_norms=[grad_norm(step) if per_step_grad_norms else None for step in steps])
    lines = []
    for step in range(RECORD_EVERY, len(losses) + 1, RECORD_EVERY):
        lines.append({"step": step, "loss": losses[step - 1], "metrics": {
            "symptom/max_attn_logit": max_logit(step), "symptom/grad_norm": grad_norm(step)},
            "alerts": [a for a in alerts if a["step"] == step]})
    (run_dir / "mech.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


ATTENTION_ALERT = {"metric": "attn/layer1/head0/delta2_entropy", "family": "attention", "step": 110, "value": 0.01,
                   "baseline": 0.25, "score": 9.0, "detail": {"layer": 1, "head": 0, "term": "delta2"}}


def _demo(tmp_path, fault_logit, fault_grad_norm):
    clean_losses = [3.0] * STEPS
    # The fault run's loss climbs 0.002 nats a step from step 101: its 20-step moving-average gap to the clean run
    # grows to the end, where it is the mean of 0.002 × (81..100) = 0.181 nats.
    fault_losses = [3.0 if s <= START else 3.0 + 0.002 * (s - START) for s in range(1, STEPS + 1)]
    _write_run(tmp_path / "clean", clean_losses, lambda s: 10.0, lambda s: 1.0)
    _write_run(tmp_path / "attention", fault_losses, fault_logit, fault_grad_norm, [ATTENTION_ALERT])
    return demo_report(tmp_path, ["clean", "attention"], seed=21, steps=STEPS, start=START, plots=False)


def _line(report, start):
    found = [line for line in report.splitlines() if line.startswith(start)]
    assert len(found) == 1, report
    return found[0]


def test_attention_act_reports_the_logit_crossings_and_the_incumbents(tmp_path):
    # Max logit 10, then from step 101 up 5 per step: 95 at step 115, 110 at step 120 (first record above the
    # QK-clip level 100), 210 at step 140 (first of the 13 records ≥ 200 to step 200: the explosion criterion,
    # 10 records, is met from step 140); 510 at step 200. Grad norm 1, 30 from step 150 (over the level 20 there;
    # OLMo's 6σ rule cannot fire: a window of constant values has no spread, and 30 is never 6σ above a window
    # holding both 1s and 30s).
    report = _demo(tmp_path, lambda s: 10.0 if s <= START else 10.0 + 5 * (s - START),
                   lambda s: 1.0 if s < 150 else 30.0)
    assert _line(report, "- clean run:") == "- clean run: 0 alerts (false alarms); incumbent alarms on it, from step 1: none fired"
    assert _line(report, "- attention outcome") == (
        "- attention outcome (the max attention logit and the loss, measured apart from the monitors): max logit 10 "
        "before the fault → 510 at step 200; above the QK-clip level (100) from step 120; max-logit explosion "
        "(≥ 200 for 10 consecutive records): from step 140; 20-step moving-average loss gap to the clean run: "
        "+0.181 nats at the end (largest after onset +0.181, step 200)")
    assert _line(report, "- our first attention alert") == (
        "- our first attention alert: 110; incumbent alarms on the same run from the fault's onset (step 100): max "
        "logit > 100 (QK-clip) at 120; ZClip grad-norm z-score at 150; grad norm > 20 at 150; silent: Megatron spiky "
        "loss, OLMo loss spike, OLMo grad-norm spike, llm-foundry loss spike — ours 10 steps before the first of them")
    assert "first attention alert: 110" in report
    # the loss gap ends at 0.181 nats, under the 0.2 of a divergence; the first incumbent fires at 120
    assert _line(report, "- attention-precision fault:").endswith(
        "**early**: first attention alert at 110, the loss did not diverge within the run, 10 steps before the first "
        "incumbent alarm (max logit > 100 (QK-clip))")
    # the title is the verdict, computed: ahead of the nearest rival (the QK-clip level at 120)
    assert report.splitlines()[0] == "# megatron-mech demo (seed 21): attention-precision fault caught first, 10 steps ahead"


def test_an_incumbent_alarm_before_the_fault_is_not_a_detection_of_it(tmp_path):
    # The grad norm is 30 (over the level 20) at steps 40-50, long before the fault (step 100), and again from step
    # 150. The clean run's line lists the early alarm; the fault run is compared with the alarm from the onset on.
    clean_losses = [3.0] * STEPS
    early_and_late = lambda s: 30.0 if 40 <= s <= 50 or s >= 150 else 1.0  # noqa: E731
    _write_run(tmp_path / "clean", clean_losses, lambda s: 10.0, lambda s: 30.0 if 40 <= s <= 50 else 1.0)
    _write_run(tmp_path / "attention", clean_losses, lambda s: 10.0, early_and_late, [ATTENTION_ALERT])
    report = demo_report(tmp_path, ["clean", "attention"], seed=21, steps=STEPS, start=START, plots=False)
    assert "grad norm > 20 at 40" in _line(report, "- clean run:")
    line = _line(report, "- our first attention alert")
    assert "grad norm > 20 at 150" in line and line.endswith("— ours 40 steps before the first of them")
    assert _line(report, "- attention-precision fault:").startswith("- attention-precision fault: **early**")


def test_the_grad_norm_rules_judge_every_step_when_the_runs_kept_it(tmp_path):
    # The grad norm is 30 at steps 151-153 only, between the records of 150 and 155: the per-step series shows the
    # level's firing at its own step, 151; a run that kept only its records' grad norms shows nothing. The report
    # says which series the rules read.
    spike = lambda s: 30.0 if 151 <= s <= 153 else 1.0  # noqa: E731
    losses = [3.0] * STEPS
    for name, per_step in (("per_step", True), ("records", False)):
        _write_run(tmp_path / name / "clean", losses, lambda s: 10.0, lambda s: 1.0, per_step_grad_norms=per_step)
        _write_run(tmp_path / name / "attention", losses, lambda s: 10.0, spike, [ATTENTION_ALERT],
                   per_step_grad_norms=per_step)
    reports = {name: demo_report(tmp_path / name, ["clean", "attention"], seed=21, steps=STEPS, start=START,
                                 plots=False) for name in ("per_step", "records")}
    assert "grad norm > 20 at 151" in _line(reports["per_step"], "- our first attention alert")
    assert "grad norm > 20" not in _line(reports["records"], "- our first attention alert").split("silent:")[0]
    assert "every step's grad norm (summary.json's grad_norms), as on a trainer" in reports["per_step"]
    assert "the grad norm at the monitor records only" in reports["records"]
    assert "the grad norm at the monitor records only" not in reports["per_step"]


@pytest.mark.parametrize("ours, divergence, incumbent, expected", [
    (110, 140, (120, "QK-clip"), "**early**: first monitor alert at 110, 30 steps before the loss diverged, 10 steps "
                                 "before the first incumbent alarm (QK-clip)"),
    # the demo on an unseen seed: the loss diverged at 299, OLMo's grad-norm spike fired at 285, ours at 305
    (305, 299, (285, "OLMo grad-norm spike"), "**late**: first monitor alert at 305, 6 steps after the loss diverged, "
                                              "20 steps after the first incumbent alarm (OLMo grad-norm spike)"),
    (120, None, None, "**early**: first monitor alert at 120, the loss did not diverge within the run, no incumbent "
                      "alarm fired"),
    (None, 299, (285, "QK-clip"), "**missed**: no monitor alert; first incumbent alarm: QK-clip at 285"),
    # at the step of the first incumbent, before the divergence: a tie, neither early nor late
    (410, 514, (410, "QK-clip"), "**tie**: first monitor alert at 410, 104 steps before the loss diverged, at the "
                                 "same step as the first incumbent alarm (QK-clip)"),
    (410, 410, None, "**tie**: first monitor alert at 410, at the step the loss diverged, no incumbent alarm fired"),
    (410, 405, (410, "QK-clip"), "**late**: first monitor alert at 410, 5 steps after the loss diverged, at the same "
                                 "step as the first incumbent alarm (QK-clip)"),
])
def test_the_verdict_is_computed_from_the_steps(ours, divergence, incumbent, expected):
    assert verdict(ours, divergence, incumbent) == expected


@pytest.mark.parametrize("ours, divergence, incumbent, expected", [
    (295, 336, (320, "OLMo grad-norm spike"), "act caught first, 25 steps ahead"),
    (305, 299, (285, "OLMo grad-norm spike"), "act caught late, 20 steps behind"),
    (285, None, (285, "QK-clip"), "act caught in a tie"),
    # no counted rival: the title says so without claiming that nothing fired (an uncounted alarm may have)
    (120, None, None, "act caught at step 120, before any counted alarm (the loss did not diverge)"),
    (None, 299, None, "act missed"),
])
def test_the_headline_is_computed_from_the_steps(ours, divergence, incumbent, expected):
    assert headline("act", ours, divergence, incumbent) == expected


def test_an_explosion_cut_short_by_the_end_of_the_run_is_not_met(tmp_path):
    # 150 from step 120 (above the QK-clip level), 250 in the last 3 records (190, 195, 200): short of 10 records.
    report = _demo(tmp_path, lambda s: 10.0 if s < 120 else 150.0 if s < 190 else 250.0, lambda s: 1.0)
    line = _line(report, "- attention outcome")
    assert "above the QK-clip level (100) from step 120;" in line
    assert "max-logit explosion (≥ 200 for 10 consecutive records): not met within the run (≥ 200 in its last 3 " \
           "records);" in line
    assert _line(report, "- our first attention alert").endswith("— ours 10 steps before the first of them")


@pytest.mark.parametrize("ours, verdict", [(None, ""), (130, " — ours 10 steps after the first of them")])
def test_incumbents_line_without_or_after_our_alert(tmp_path, ours, verdict):
    _write_run(tmp_path / "run", [3.0] * STEPS, lambda s: 10.0 if s < 120 else 150.0, lambda s: 1.0)
    line = incumbents_line(load_demo_run(tmp_path / "run", 21), ours)
    assert line == (f"our first monitor alert: {ours or 'none'}; incumbent alarms on the same run: max logit > 100 "
                    f"(QK-clip) at 120; silent: Megatron spiky loss, OLMo loss spike, OLMo grad-norm spike, ZClip "
                    f"grad-norm z-score, llm-foundry loss spike, grad norm > 20{verdict}")


def test_an_incumbent_alarm_that_rings_on_the_clean_run_later_is_not_counted_either(tmp_path):
    # The fault run's grad norm spikes to 30 at step 130 (over the level 20, a ZClip z-score spike); the clean run's
    # at 170 and 190, after it: the rules ring without the fault, so the fault run's firing at 130 is no warning
    # (the monitors' alerts are held to none on a clean run). Only the QK-clip level at 160 counts: ours at 110 is
    # 50 steps ahead of it, not 20 ahead of the grad-norm spike.
    losses = [3.0] * STEPS
    _write_run(tmp_path / "clean", losses, lambda s: 10.0, lambda s: 30.0 if s in (170, 190) else 1.0,
               per_step_grad_norms=True)
    _write_run(tmp_path / "attention", losses, lambda s: 150.0 if s >= 160 else 10.0,
               lambda s: 30.0 if s == 130 else 1.0, [ATTENTION_ALERT], per_step_grad_norms=True)
    report = demo_report(tmp_path, ["clean", "attention"], seed=21, steps=STEPS, start=START, plots=False)
    line = _line(report, "- our first attention alert")
    assert "grad norm > 20 (here 130; on the clean run from the onset: first 170, at 2 steps)" in line
    assert "ZClip grad-norm z-score (here 130; on the clean run from the onset: first 170, at 2 steps)" in line
    assert report.splitlines()[0].endswith("attention-precision fault caught first, 50 steps ahead")


def test_the_attention_act_states_the_fault_its_command_injects(tmp_path):
    # The reference is the attention run's own command line, parsed by the fault flags' parser: the report must
    # name the layer and γ the run injects, not the lead-time study's setting.
    import argparse

    from megatron_mech.studies.demo import demo_commands
    from megatron_mech.studies.fault_config import FaultConfig, add_fault_arguments
    from megatron_mech.studies.pretrain_gpt_fault import ENTRY_MODULE

    args = argparse.Namespace(quick=False, steps=STEPS, fault_start=START, faults=["attention"], seed=21,
                              out=str(tmp_path / "runs"))
    cmd = demo_commands(args)["attention"]
    flags, _ = add_fault_arguments(argparse.ArgumentParser()).parse_known_args(cmd[cmd.index(ENTRY_MODULE) + 1:])
    fault = FaultConfig.from_args(flags)
    assert (fault.kind, fault.start) == ("attention", START)
    report = _demo(tmp_path, lambda s: 10.0, lambda s: 1.0)
    layers = " ".join(str(layer) for layer in fault.layers)
    assert fault.ramp > 0  # a fault that develops
    assert _line(report, "Fault:") == (
        f"Fault: the biased bf16-rounding mechanism of FlashAttention's backward injected into layer {layers}, "
        f"γ growing from 0 to {fault.gamma:g} over {fault.ramp} steps, from step {START}.")


def test_an_incumbent_alarm_that_rings_as_early_on_the_clean_run_is_not_counted(tmp_path):
    # Both runs' grad norm jumps to 30 at step 150 (over the level 20; ZClip's z-score fires there too): the same
    # alarms ring without the fault, so they are named and not counted; the fault run's max logit passes the
    # QK-clip level at 160, which the clean run never does: that one counts.
    losses = [3.0] * STEPS
    _write_run(tmp_path / "clean", losses, lambda s: 10.0, lambda s: 30.0 if s >= 150 else 1.0)
    _write_run(tmp_path / "attention", losses, lambda s: 150.0 if s >= 160 else 10.0,
               lambda s: 30.0 if s >= 150 else 1.0, [ATTENTION_ALERT])
    report = demo_report(tmp_path, ["clean", "attention"], seed=21, steps=STEPS, start=START, plots=False)
    line = _line(report, "- our first attention alert")
    assert "not counted, as they fired on the clean run too: " in line
    # the level rule fires on each of the clean run's records from 150 to 200 (the grad norm read at the records)
    assert "grad norm > 20 (here 150; on the clean run from the onset: first 150, at 11 steps)" in line
    assert line.endswith("— ours 50 steps before the first of them")  # the QK-clip level at 160
    assert _line(report, "- attention-precision fault:").endswith(
        "50 steps before the first incumbent alarm (max logit > 100 (QK-clip))")
    assert report.splitlines()[0].endswith("attention-precision fault caught first, 50 steps ahead")
