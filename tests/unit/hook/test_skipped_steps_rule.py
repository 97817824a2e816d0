"""The skipped-steps rule: the steps the optimizer skipped since the previous evaluation, named in one alert that
words itself, and the run's total kept across a resume."""
import json

import torch

from megatron_mech.config import MechConfig, MonitorConfig, OutputConfig
from megatron_mech.core.attribution import alert_lines
from megatron_mech.hook import MechHook
from megatron_mech.model_view import ModelView
from megatron_mech.monitors.attention import AttentionLayer
from megatron_mech.hook.skipped_steps import SKIPPED_METRIC, SkippedSteps


def judged(rule, step, metrics):
    """The verdict of evaluation ``step``, adopted as the hook adopts an evaluation collected in time."""
    verdict = rule.verdict(step)(metrics)
    rule.adopt(verdict)
    return verdict.alert


def test_the_alert_names_the_skipped_steps_of_the_interval_and_the_runs_total():
    rule = SkippedSteps()
    for step in range(1, 11):
        rule.observe(step, skipped=step >= 5, lr=1e-4)
    alert = judged(rule, 10, {})
    assert alert.value == 6.0 and alert.metric == SKIPPED_METRIC and alert.family == "symptom" and alert.step == 10
    assert alert.detail["cause"] == "optimizer_skipped"   # the diagnosis names it as such, no other cause
    assert alert_lines([alert]) == ["optimizer steps skipped: 6 of the last 10 (steps 5-10); weights unchanged while "
                                    "the LR was > 0; 6 in the run so far"]
    for step in range(11, 21):
        rule.observe(step, skipped=step <= 15, lr=0.0 if step == 11 else 1e-4)
    alert = judged(rule, 20, {})
    # a step skipped at LR 0 is not one whose weights stayed put while the LR asked them to move
    assert alert.value == 5.0 and alert_lines([alert]) == ["optimizer steps skipped: 5 of the last 10 (steps 11-15); "
                                                           "11 in the run so far"]
    for step in range(21, 31):
        rule.observe(step, skipped=False, lr=1e-4)
    assert judged(rule, 30, {"attn/layer0/dwq_frozen": 1.0}) is None   # the trainer said: none skipped
    resumed = SkippedSteps()
    resumed.load_state_dict(rule.state_dict())
    assert resumed.total == 11


def test_a_loss_scalers_start_up_search_and_its_occasional_overflow_are_counted_not_alerted():
    """Megatron's fp16 loss scaler starts at 2^32 and skips steps until it finds its scale, then skips a step now and
    then when it grows the scale into an overflow: both are its routine, counted in the total, not alerted. Skipping
    at least half of an interval once a step went through is."""
    rule = SkippedSteps()
    for step in range(1, 11):   # the start-up search: every step skipped, none yet went through
        rule.observe(step, skipped=True, lr=1e-4)
    assert judged(rule, 10, {}) is None and rule.total == 10
    for step in range(11, 21):   # training, one overflow skip
        rule.observe(step, skipped=step == 17, lr=1e-4)
    assert judged(rule, 20, {}) is None and rule.total == 11
    for step in range(21, 31):   # half of the interval skipped: sustained
        rule.observe(step, skipped=step > 25, lr=1e-4)
    alert = judged(rule, 30, {})
    assert alert.value == 5.0 and rule.total == 16
    resumed = SkippedSteps()   # a resumed run knows a step went through: its skips are not a start-up search
    resumed.load_state_dict(rule.state_dict())
    for step in range(31, 41):
        resumed.observe(step, skipped=True, lr=1e-4)
    assert judged(resumed, 40, {}).value == 10.0


def test_a_verdict_changes_nothing_until_it_is_adopted():
    """The verdict may run on the evaluation worker: one that is given up (never adopted) leaves the total and what
    the rule knows of the weights as they were."""
    rule = SkippedSteps()
    for step in range(1, 6):
        rule.observe(step, skipped=None, lr=1e-4)
    judged(rule, 5, {"attn/layer0/dwq_frozen": 0.0})   # the weights moved
    for step in range(6, 11):
        rule.observe(step, skipped=None, lr=1e-4)
    verdict = rule.verdict(10)({"attn/layer0/dwq_frozen": 1.0})
    assert verdict.alert.value == 5.0 and verdict.inferred == 5
    assert rule.total == 0 and rule.state_dict() == {"total": 0, "moved": True, "stepped": False}


def test_where_the_trainer_cannot_tell_a_frozen_delta_w_at_a_positive_lr_is_the_signal():
    rule = SkippedSteps()
    for step in range(1, 6):
        rule.observe(step, skipped=None, lr=1e-4)
    # weights that never moved are no training run's (a fixture, an evaluation loop): nothing to name
    assert judged(rule, 5, {"attn/layer0/dwq_frozen": 1.0, "attn/layer0/dwk_frozen": 1.0}) is None
    for step in range(6, 11):
        rule.observe(step, skipped=None, lr=1e-4)
    assert judged(rule, 10, {"attn/layer0/dwq_frozen": 1.0, "attn/layer0/dwk_frozen": 0.0}) is None   # one moved
    assert rule.total == 0
    for step in range(11, 16):
        rule.observe(step, skipped=None, lr=1e-4)
    alert = judged(rule, 15, {"attn/layer0/dwq_frozen": 1.0, "attn/layer0/dwk_frozen": 1.0})
    assert alert.value == 5.0 and rule.total == 5
    assert alert_lines([alert]) == ["optimizer steps skipped: 5 of the last 5 (steps 11-15); weights unchanged while "
                                    "the LR was > 0 (every monitored ΔW is zero; the trainer reports no skips); 5 "
                                    "in the run so far"]
    for step in range(16, 21):   # frozen at LR 0 (a warm-up from zero, a finished schedule): nothing skipped
        rule.observe(step, skipped=None, lr=0.0)
    assert judged(rule, 20, {"attn/layer0/dwq_frozen": 1.0, "attn/layer0/dwk_frozen": 1.0}) is None
    assert judged(rule, 25, {}) is None   # no step, no metric: nothing to judge
    resumed = SkippedSteps()
    resumed.load_state_dict(rule.state_dict())
    for step in range(26, 31):
        resumed.observe(step, skipped=None, lr=1e-4)
    assert judged(resumed, 30, {"attn/layer0/dwq_frozen": 1.0}).value == 5.0   # it knows the weights moved before


def test_the_hook_names_reported_skips_at_the_next_evaluation_and_keeps_the_total_in_its_state(tmp_path):
    """Through MechHook: skips reported on steps 3-4 (no evaluation there) are named at evaluation step 4 in the
    record, counted in the hook's state, which a new hook restores."""
    def hook_over(weight):
        config = MechConfig(monitors=MonitorConfig(families=("attention",), interval=2, qk_terms=("delta2",)),
                            output=OutputConfig(dir=str(tmp_path / "run")))
        hook = MechHook(config, train_steps=8)
        hook.setup(ModelView(attention_layers=[AttentionLayer(0, weight, 2, 2, 4)]), None)
        return hook

    weight = torch.randn(24, 16, generator=torch.Generator().manual_seed(0))
    hook = hook_over(weight)
    for step in range(1, 7):
        hook.before_step(step)
        if step not in (3, 4):   # a skipped step leaves the weights as they were
            weight.add_(0.01 * torch.randn(weight.shape, generator=torch.Generator().manual_seed(step)))
        hook.after_optimizer_step(step, loss=1.0, grad_norm=1.0, lr=1e-3, skipped=step in (3, 4))
    state = hook.state_dict()
    hook.close()
    records = {r["step"]: r for r in map(json.loads, (tmp_path / "run" / "mech.jsonl").read_text().splitlines())}
    assert records[4]["metrics"][SKIPPED_METRIC] == 2.0
    assert [a["metric"] for a in records[4]["alerts"]] == [SKIPPED_METRIC]
    assert SKIPPED_METRIC not in records[2]["metrics"] and SKIPPED_METRIC not in records[6]["metrics"]
    assert hook.skipped_steps.total == 2 and state["skipped_steps"]["total"] == 2
    restored = MechHook(MechConfig(monitors=MonitorConfig(families=("attention",), interval=2)))
    restored.load_state_dict(state)
    assert restored.skipped_steps.total == 2


def test_the_hook_names_an_unreported_interval_of_unchanged_weights(tmp_path):
    """A trainer that reports no skips: the interval of steps 3-4, in which the weights did not move at LR > 0, is
    named at evaluation step 4 from the attention monitor's ΔW; the moving intervals are not."""
    config = MechConfig(monitors=MonitorConfig(families=("attention",), interval=2, qk_terms=("delta2",)),
                        output=OutputConfig(dir=str(tmp_path / "run")))
    weight = torch.randn(24, 16, generator=torch.Generator().manual_seed(0))
    hook = MechHook(config, train_steps=8)
    hook.setup(ModelView(attention_layers=[AttentionLayer(0, weight, 2, 2, 4)]), None)
    for step in range(1, 7):
        hook.before_step(step)
        if step not in (3, 4):
            weight.add_(0.01 * torch.randn(weight.shape, generator=torch.Generator().manual_seed(step)))
        hook.after_optimizer_step(step, loss=1.0, grad_norm=1.0, lr=1e-3)
    hook.close()
    records = {r["step"]: r for r in map(json.loads, (tmp_path / "run" / "mech.jsonl").read_text().splitlines())}
    assert [a["metric"] for a in records[4]["alerts"]] == [SKIPPED_METRIC]
    assert records[4]["metrics"][SKIPPED_METRIC] == 2.0
    assert not records[2]["alerts"] and not records[6]["alerts"] and hook.skipped_steps.total == 2
