"""The skipped-steps rule: the steps the optimizer skipped since the previous evaluation, named in one alert that
words itself, and the run's total kept across a resume."""
from megatron_mech.core.attribution import alert_lines
from megatron_mech.skipped_steps import SKIPPED_METRIC, SkippedSteps


def test_the_alert_names_the_skipped_steps_of_the_interval_and_the_runs_total():
    rule = SkippedSteps()
    for step in range(1, 11):
        rule.observe(step, skipped=step >= 7, lr=1e-4)
    alert = rule.alert(10)
    assert alert.value == 4.0 and alert.metric == SKIPPED_METRIC and alert.family == "symptom" and alert.step == 10
    assert alert_lines([alert]) == ["optimizer steps skipped: 4 of the last 10 (steps 7-10); weights unchanged while "
                                    "the LR was > 0; 4 in the run so far"]
    for step in range(11, 21):
        rule.observe(step, skipped=step == 11, lr=0.0 if step == 11 else 1e-4)
    alert = rule.alert(20)
    # a step skipped at LR 0 is not one whose weights stayed put while the LR asked them to move
    assert alert.value == 1.0 and alert_lines([alert]) == ["optimizer steps skipped: 1 of the last 10 (step 11); 5 in the "
                                                      "run so far"]
    for step in range(21, 31):
        rule.observe(step, skipped=False, lr=1e-4)
    assert rule.alert(30) is None
    resumed = SkippedSteps()
    resumed.load_state_dict(rule.state_dict())
    assert resumed.total == 5


def test_a_trainer_that_cannot_tell_raises_nothing():
    rule = SkippedSteps()
    for step in range(1, 6):
        rule.observe(step, skipped=None, lr=1e-4)
    assert rule.alert(5) is None
    assert rule.total == 0
