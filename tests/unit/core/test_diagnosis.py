"""The diagnosis of alerts from the pattern of signals at the evaluation that fired, through the real registry: the
cause each alert carries, the line it gets, and the first alert's diagnosis a study scores."""
import math

import pytest

from megatron_mech.core.attribution import alert_lines, summarize_alerts
from megatron_mech.core.detect import MAX_LOGIT_LEVEL, Alert, DetectorRegistry
from megatron_mech.monitors.registry import default_registry
from megatron_mech.core.diagnosis import diagnose_evaluation, first_diagnosis

LAYERS, HEADS = 4, 3


def healthy(step, *, collapsed=(), loss=2.0, router=True, frozen=False, logits=None):
    """One evaluation of a 4-layer model: per-head Δ2 and per-layer ΔW entropies (``collapsed`` layers near 0), the
    maximum logit of every layer, a router's entropies, the frozen-weight flags and the loss."""
    wiggle = 0.01 * math.sin(step)
    values = {}  # unchanged weights have no update spectrum: their entropies are not measured (None)
    for layer in range(LAYERS):
        low = layer in collapsed
        for head in range(HEADS):
            values[f"attn/layer{layer}/head{head}/delta2_entropy"] = (
                None if frozen else 0.001 if low else 0.3 + wiggle + 0.01 * head)
        for m in "qk":
            values[f"attn/layer{layer}/dw{m}_entropy"] = None if frozen else 0.002 if low else 0.5 + wiggle
            values[f"attn/layer{layer}/dw{m}_frozen"] = 1.0 if frozen else 0.0
        values[f"symptom/max_attn_logit/layer{layer}"] = (logits or {}).get(layer, 12.0 + wiggle)
        if router:
            values[f"router/layer{layer}/entropy_mean"] = 1.2 + wiggle
            values[f"router/layer{layer}/load_entropy"] = 1.35 + wiggle
    values["symptom/loss"] = loss + wiggle
    return values


def details(values):
    from megatron_mech.core.detect import layer_of

    out = {}
    for name in values:
        layer = layer_of(name)
        if layer is not None:
            out[name] = {"layer": layer, **({"head": int(name.split("/head")[1].split("/")[0])} if "/head" in name
                                            else {})}
    return out


def registry_after_baseline(steps=12):
    """A registry with a short warm-up and baseline (the quick demo's kind of settings), fed ``steps`` healthy
    evaluations: every baseline-relative rule is monitoring."""
    registry = default_registry({"warmup": 2, "baseline": 6})
    for i in range(1, steps + 1):
        values = healthy(5 * i)
        assert registry.update(5 * i, values, details(values)) == []
    return registry


def fire(registry, step, values):
    return registry.update(step, values, details(values))


def test_max_logit_level_in_every_layer_is_a_learning_rate_problem_named_by_metric_and_level():
    registry = default_registry()  # the level rules are armed from the first evaluation
    values = healthy(5, logits={0: 1.17e9, 1: 3e8, 2: 9e7, 3: 4e6})
    alerts = fire(registry, 5, values)
    assert {a.detail["cause"] for a in alerts} == {"learning_rate"}
    line = alert_lines(registry.alerts)[0]
    assert line.startswith("learning-rate / global-scale problem suspected, seen in layer 0")
    assert f"max attention logit 1.17e+09 above level {MAX_LOGIT_LEVEL:.3g}" in line and "baseline" not in line
    first = first_diagnosis(registry.alerts)
    assert (first.cause, first.step, first.layers) == ("learning_rate", 5, [])


def test_max_logit_level_in_one_layer_while_its_peers_stay_below_is_that_layers_logit_growth():
    registry = default_registry()
    alerts = fire(registry, 5, healthy(5, logits={2: 450.0}))
    assert [a.detail["cause"] for a in alerts] == ["logit_growth"]
    assert alert_lines(alerts)[0].startswith("attention-logit growth suspected in layer 2 (max attention logit 450 "
                                             "above level 100")


def test_one_layers_logits_passing_the_level_as_its_update_spectrum_collapses_are_its_precision_fault():
    # The precision fault's own mechanism: the layer's updates turn low-rank and its logits grow. The logit level
    # fires at once, the entropies only after their persistence; the layer's entropies out of band at that same
    # evaluation name the cause.
    registry = registry_after_baseline()
    alerts = fire(registry, 65, healthy(65, collapsed=(1,), logits={1: 450.0}))
    assert [(a.metric, a.detail["cause"]) for a in alerts] == [("symptom/max_attn_logit/layer1", "precision")]
    assert (first_diagnosis(alerts).cause, first_diagnosis(alerts).layers) == ("precision", [1])
    # another layer's collapse does not make this layer's logit growth a precision fault
    registry = registry_after_baseline()
    alerts = fire(registry, 65, healthy(65, collapsed=(3,), logits={1: 450.0}))
    assert [a.detail["cause"] for a in alerts] == ["logit_growth"]


def test_one_layers_entropy_collapse_with_peers_in_band_is_a_precision_fault_there():
    registry = registry_after_baseline()
    alerts = []
    for step in (65, 70, 75):  # persistence 3
        alerts += fire(registry, step, healthy(step, collapsed=(1,)))
    assert alerts and {a.detail["cause"] for a in alerts} == {"precision"}
    assert {a.detail["layer"] for a in alerts} == {1}
    assert alert_lines(alerts)[0].startswith("attention-precision fault suspected in layer 1, heads 0, 1 and 2 "
                                             "(Δ2 spectral entropy 0.001 vs baseline")
    assert first_diagnosis(registry.alerts).layers == [1]


def test_every_layers_entropy_collapse_together_is_a_global_cause():
    registry = registry_after_baseline()
    for step in (65, 70, 75):
        fire(registry, step, healthy(step, collapsed=range(LAYERS)))
    first = first_diagnosis(registry.alerts)
    assert first.cause == "learning_rate" and first.layers == []


def test_router_fall_without_attention_signature_is_router_collapse():
    registry = registry_after_baseline(40)  # the load rule's warm-up is at least 30 evaluations
    values = healthy(205)
    values["router/layer2/load_entropy"] = 0.4
    alerts = fire(registry, 205, values)
    assert [a.detail["cause"] for a in alerts] == ["router"]
    assert first_diagnosis(alerts).layers == [2]


def test_a_loss_jump_with_no_internal_signature_is_data_and_later_alerts_follow_it():
    registry = registry_after_baseline(40)
    alerts = [a for step in (205, 210, 215) for a in fire(registry, step, healthy(step, loss=9.0))]  # persistence
    assert [(a.metric, a.step, a.detail["cause"]) for a in alerts] == [("symptom/loss", 215, "data")]
    assert "follows" not in alerts[0].detail
    values = healthy(220, loss=9.0)
    values["router/layer2/load_entropy"] = 0.4
    later = fire(registry, 220, values)
    assert later and all(a.detail["follows"] == {"cause": "data", "step": 215} for a in later)
    lines = alert_lines(registry.alerts)
    assert lines[0].startswith("data problem suspected (the loss jumped with no attention or learning-rate signature) "
                               "(loss 9")
    assert lines[1].startswith("after the data problem (step 215), likely its consequence: router layer 2")


def test_routing_that_moves_at_the_evaluation_the_loss_jumps_is_data_not_router_collapse():
    # Corrupted data moves the routers at once (they read other tokens) in the evaluation where the loss jumps; the
    # router rule fires at once, the loss rule only after its persistence. The loss out of band at that evaluation
    # names the cause.
    registry = registry_after_baseline(40)
    values = healthy(205, loss=9.0)
    values["router/layer2/load_entropy"] = 0.4
    alerts = fire(registry, 205, values)
    assert [(a.metric, a.detail["cause"]) for a in alerts] == [("router/layer2/load_entropy", "data")]
    assert first_diagnosis(alerts).cause == "data" and first_diagnosis(alerts).layers == []
    # the same routing move with the loss in band stays a router collapse
    registry = registry_after_baseline(40)
    values = healthy(205)
    values["router/layer2/load_entropy"] = 0.4
    assert [a.detail["cause"] for a in fire(registry, 205, values)] == ["router"]


def test_a_non_finite_grad_norm_on_a_step_the_optimizer_skipped_is_the_skip_not_a_blow_up():
    # DeepSpeed's bf16 optimizer skips a step whose gradients are non-finite (with gradient clipping it also reports
    # the non-finite norm): the weights kept their values, the loss is finite. The trainer's report of the skip
    # names the cause.
    registry = registry_after_baseline(40)
    values = {**healthy(205), "symptom/grad_norm": math.inf, "symptom/optimizer_step_skipped": 1.0}
    alerts = fire(registry, 205, values)
    assert [(a.metric, a.detail["cause"]) for a in alerts] == [("symptom/grad_norm", "optimizer_skipped")]
    assert first_diagnosis(alerts).cause == "optimizer_skipped"
    assert alert_lines(alerts)[0].startswith("optimizer steps skipped")
    # without the trainer's report it is a global blow-up, as before; a non-finite loss is one whatever is reported
    registry = registry_after_baseline(40)
    assert [a.detail["cause"] for a in fire(registry, 205, {**healthy(205), "symptom/grad_norm": math.inf})] == [
        "nonfinite"]
    registry = registry_after_baseline(40)
    values = {**healthy(205), "symptom/loss": math.nan, "symptom/grad_norm": math.inf,
              "symptom/optimizer_step_skipped": 1.0}
    assert {a.detail["cause"] for a in fire(registry, 205, values)} == {"nonfinite"}


def test_unchanged_weights_at_every_layer_are_skipped_optimizer_steps():
    registry = registry_after_baseline(40)  # the weights moved at every evaluation so far
    alerts = [a for step in (205, 210, 215) for a in fire(registry, step, healthy(step, loss=9.0, frozen=True))]
    assert [a.detail["cause"] for a in alerts] == ["optimizer_skipped"]
    assert first_diagnosis(registry.alerts).cause == "optimizer_skipped"
    resumed = default_registry({"warmup": 2, "baseline": 6})
    resumed.load_state_dict(registry.state_dict())
    assert resumed.weights_moved  # kept with the detectors' state


def test_weights_frozen_from_the_start_are_a_frozen_base_model_not_skipped_steps():
    """A LoRA-style run: the monitored base weights never change; a loss jump there is not blamed on the optimizer."""
    registry = default_registry({"warmup": 2, "baseline": 6})
    for i in range(1, 41):
        assert fire(registry, 5 * i, healthy(5 * i, frozen=True)) == []
    alerts = [a for step in (205, 210, 215) for a in fire(registry, step, healthy(step, loss=9.0, frozen=True))]
    assert [a.detail["cause"] for a in alerts] == ["data"] and not registry.weights_moved


def test_a_grad_norm_rise_alone_is_unclassified_with_its_signals():
    alert = Alert("symptom/grad_norm", "symptom", 400, 9.0, 1.0, 30.0)
    diagnosis = diagnose_evaluation([alert])
    assert diagnosis.cause == "unclassified" and diagnosis.signals == ["grad-norm (baseline)"]
    line = alert_lines([alert])[0]
    assert line.startswith("unclassified (grad-norm 9 vs baseline 1") and "no cause's pattern matched" in line


def test_layer_trend_line_names_the_rule():
    alert = Alert("attn/layer1/head0/delta2_entropy", "attention", 200, 0.05, 0.2, 1.6,
                  {"layer": 1, "head": 0, "layer_change": 1.6, "series_change": 1.9, "window": 10, "series": 3})
    group = summarize_alerts([alert])[0]
    assert group["rule"] == "layer_trend" and group["cause"] == "precision"
    assert "the layer's median fell 1.6 log units over 10 evaluations (layer trend)" in alert_lines([alert])[0]


def test_stamped_causes_survive_the_records_and_a_resume():
    registry = default_registry()
    fire(registry, 5, healthy(5, logits={0: 1e9, 1: 1e9, 2: 1e9, 3: 1e9}))
    records = [Alert.from_dict(a.to_dict()) for a in registry.alerts]  # as mech.jsonl and summary.json keep them
    assert first_diagnosis(records).cause == "learning_rate"
    resumed = default_registry()
    resumed.load_state_dict(registry.state_dict())
    assert first_diagnosis(resumed.alerts).cause == "learning_rate"
    values = healthy(10, loss=2.0, logits={0: 12.0, 1: 12.0, 2: 12.0, 3: 900.0})  # layer 3 still above: latched
    values["router/layer0/entropy_mean"] = math.nan  # one non-finite series of one place: its own alert
    later = fire(resumed, 10, values)
    assert [a.detail["follows"] for a in later] == [{"cause": "learning_rate", "step": 5}]


@pytest.mark.parametrize("values", [None, {}])
def test_no_alert_no_diagnosis(values):
    assert diagnose_evaluation([], values) is None and first_diagnosis([]) is None
