"""MechHook's lifecycle in one process, framework-free: a real AttentionEvaluator on a real weight that the test
updates like an optimizer would, the real detectors and sinks, the alert policy, one-entry resume, the extension
seam and the LR fault registered through it. (The megatron-core path, with real collectives, is covered by the
torchrun training tests.)"""
from __future__ import annotations

import json
import math

import pytest
import torch

from megatron_mech.config import DetectorOverrides, MechConfig, MonitorConfig
from megatron_mech.hook import Action, Extension, MechHook
from megatron_mech.model_view import ModelView
from megatron_mech.monitors.attention import AttentionLayer
from megatron_mech.records.sinks import CallbackSink
from megatron_mech.studies.fault_config import FaultConfig
from megatron_mech.studies.injectors import FaultInjector

HEADS, GROUPS, HEAD_DIM, D_MODEL = 2, 2, 8, 16
SPIKE = 12  # the step whose loss jumps


def _config(on_alert="log", interval=2):
    return MechConfig(monitors=MonitorConfig(families=("attention",), interval=interval, qk_terms=("delta2",)),
                      detector=DetectorOverrides(warmup=0, baseline=3, persistence=1), on_alert=on_alert)


def _loss(step):
    return 5.0 - 0.01 * step + (50.0 if step >= SPIKE else 0.0)


def _update(weight, step):
    """The optimizer step of ``step``: a deterministic full-rank update of the fused QKV weight."""
    gen = torch.Generator().manual_seed(1000 + step)
    with torch.no_grad():
        weight.add_(1e-2 * torch.randn(weight.shape, generator=gen, dtype=weight.dtype))


class _Run:
    """A hook on a one-layer model view; ``records`` collects what the hook writes."""

    def __init__(self, config, weight=None, start_step=0, state=None, optimizer=None, extensions=()):
        rows = (HEADS + 2 * GROUPS) * HEAD_DIM
        self.weight = weight if weight is not None else torch.randn(
            rows, D_MODEL, generator=torch.Generator().manual_seed(0), dtype=torch.float32)
        self.records = []
        self.hook = MechHook(config, sinks=CallbackSink(self.records.append), extensions=extensions)
        view = ModelView(attention_layers=[AttentionLayer(0, self.weight, HEADS, GROUPS, HEAD_DIM)])
        assert self.hook.optimizer_overrides(view) is None  # no MoLS: nothing to change in the optimizer
        self.hook.attach_optimizer(optimizer)
        if state is not None:
            self.hook.load_state_dict(state)
        self.hook.setup(view, optimizer, start_step=start_step)

    def steps(self, first, last):
        actions = {}
        for step in range(first, last + 1):
            self.hook.before_step(step)
            _update(self.weight, step)
            actions[step] = self.hook.after_optimizer_step(step, loss=_loss(step), grad_norm=1.0, lr=1e-3)
        return actions


def test_records_on_the_interval_grid_and_stop_on_the_first_alert_only():
    run = _Run(_config(on_alert="stop"))
    actions = run.steps(1, 16)
    assert [r["step"] for r in run.records] == [2, 4, 6, 8, 10, 12, 14, 16]  # multiples of the interval only
    assert all("attn/layer0/head1/delta2_entropy" in r["metrics"] for r in run.records)
    alerted = [r["step"] for r in run.records if r["alerts"]]
    assert alerted and alerted[0] == SPIKE and {a["family"] for a in run.records[5]["alerts"]} == {"symptom"}
    # the first alert decides (stop); later alerts only log; steps without an evaluation never act
    assert actions[SPIKE] is Action.STOP
    assert all(a is Action.CONTINUE for s, a in actions.items() if s != SPIKE)
    assert run.hook.first_alert_step == SPIKE
    assert Action("checkpoint") is Action.CHECKPOINT  # the policy's values are the flag's


def _blow_up_loss(step):
    """Finite, except non-finite from step 6 (no evaluation step at interval 4)."""
    return math.nan if step >= 6 else _loss(step)


def _run_to_alert(values, steps=range(1, 11), on_alert="checkpoint", tmp_path=None):
    """A run at interval 4 fed ``values(x)`` (floats or tensors) for the loss and grad norm; saves a checkpoint at
    step 5, and wherever the hook asks, under ``tmp_path`` (then ``first_alert.json`` is written there)."""
    run = _Run(_config(on_alert=on_alert, interval=4))
    actions = {}
    for step in steps:
        run.hook.before_step(step)
        _update(run.weight, step)
        actions[step] = run.hook.after_optimizer_step(step, loss=values(_blow_up_loss(step)),
                                                      grad_norm=values(1.0 + step), lr=1e-3, extra={"n": step})
        if tmp_path is not None and (step == 5 or actions[step] is not Action.CONTINUE):
            (tmp_path / f"iter_{step:07d}").mkdir(parents=True)
            run.hook.checkpoint_saved(step, tmp_path / f"iter_{step:07d}")
    return run, actions


def test_device_values_are_read_back_at_the_next_evaluation_with_the_same_records_and_alert_steps(tmp_path):
    """Losses and grad norms given as tensors on steps without an evaluation stay unread until the next evaluation
    (no host sync per step). The reference is the same run fed floats, judged at once: the same records (the
    non-finite step 6 with its own values, lr and extra), the same alerts with the same steps, the same loss
    series; only the action comes at the read-back (step 8), and first_alert.json, written at the checkpoint the
    action asks for, still names the alert's step and the last checkpoint before it."""
    floats, float_actions = _run_to_alert(float, tmp_path=tmp_path / "floats")
    tensors, tensor_actions = _run_to_alert(lambda v: torch.tensor(v, dtype=torch.float64),
                                            tmp_path=tmp_path / "tensors")
    for run in (floats, tensors):
        run.hook.close()  # reads back steps 9 and 10 (after the last evaluation)
    assert [r["step"] for r in floats.records] == [4, 6, 8]  # the evaluations and the alert of step 6
    assert json.dumps(tensors.records) == json.dumps(floats.records)
    assert json.dumps(tensors.hook.losses) == json.dumps(floats.hook.losses) and len(floats.hook.losses) == 10
    assert floats.hook.first_alert_step == tensors.hook.first_alert_step == 6
    assert {s for s, a in float_actions.items() if a is not Action.CONTINUE} == {6}
    assert {s for s, a in tensor_actions.items() if a is not Action.CONTINUE} == {8}
    assert tensor_actions[8] is Action.CHECKPOINT
    for name, acted in (("floats", 6), ("tensors", 8)):
        record = json.loads((tmp_path / name / "first_alert.json").read_text())
        assert record == {"step": 6, "checkpoint": str(tmp_path / name / f"iter_{acted:07d}"),
                          "last_checkpoint_before_alert": 5}


def test_every_steps_grad_norm_is_kept_beside_its_loss_and_resumes():
    """The hook keeps each step's grad norm (read back like the loss when it came as a tensor) in step order, with
    None where the trainer gave none; the state carries the series, so a resumed run's series is the whole run's;
    a state saved before the series existed restores its steps as not known, and a series whose length is not the
    losses' is a damaged state, refused."""
    from megatron_mech.hook import StateError

    as_tensor = lambda v: torch.tensor(v, dtype=torch.float64)  # noqa: E731 - the floats' values exactly
    for values in (float, as_tensor):
        run, _ = _run_to_alert(values, steps=range(1, 8))
        state = run.hook.state_dict()  # reads back steps 5-7 (no evaluation since step 4)
        assert state["grad_norms"] == [1.0 + step for step in range(1, 8)]
        assert run.hook.grad_norms == state["grad_norms"] and len(run.hook.losses) == 7
    resumed = _Run(_config(interval=4), state=state, start_step=7)
    resumed.hook.before_step(8)
    resumed.hook.after_optimizer_step(8, loss=1.0, grad_norm=None, lr=1e-3)
    assert resumed.hook.grad_norms == [1.0 + step for step in range(1, 8)] + [None]
    older = {k: v for k, v in state.items() if k != "grad_norms"}
    assert _Run(_config(interval=4), state=older, start_step=7).hook.grad_norms == [None] * 7
    with pytest.raises(StateError, match="6 grad norms for 7 losses"):
        _Run(_config(interval=4), state={**state, "grad_norms": state["grad_norms"][:6]}, start_step=7)


def test_the_per_step_series_keep_a_bounded_window_of_the_last_steps(monkeypatch):
    """Every step's loss and grad norm lived in the hook's state on every rank (about 18 B a step in each rank's
    checkpoint, 60 B a step in summary.json): a 10^6-step run carried them all. The series keep the last
    STEP_SERIES_WINDOW steps (here made 5 to see it): the state and a resume from a longer state hold only those,
    each grad norm still beside its own step's loss."""
    from megatron_mech.hook import step_values

    monkeypatch.setattr(step_values, "STEP_SERIES_WINDOW", 5)
    run, _ = _run_to_alert(float, steps=range(1, 8))
    state = run.hook.state_dict()
    assert state["grad_norms"] == [1.0 + step for step in range(3, 8)]  # steps 3-7: the last five
    assert json.dumps(state["losses"]) == json.dumps([_blow_up_loss(step) for step in range(3, 8)])
    longer = {**state, "losses": [0.5] * 2 + state["losses"], "grad_norms": [9.0] * 2 + state["grad_norms"]}
    resumed = _Run(_config(interval=4), state=longer, start_step=7)
    assert resumed.hook.grad_norms == state["grad_norms"] and len(resumed.hook.losses) == 5
    resumed.hook.before_step(8)
    resumed.hook.after_optimizer_step(8, loss=1.0, grad_norm=None, lr=1e-3)
    assert resumed.hook.grad_norms == [1.0 + step for step in range(4, 8)] + [None]
    assert resumed.hook.losses[-1] == 1.0 and len(resumed.hook.losses) == 5


def test_device_values_still_unread_are_read_back_by_state_dict_and_close():
    """A checkpoint between evaluations (state_dict) and the end of a run (close) read the waiting values back:
    the state's loss series is complete and the non-finite step's record is written with its own step."""
    floats, _ = _run_to_alert(float, steps=range(1, 8))
    as_tensor = lambda v: torch.tensor(v, dtype=torch.float64)  # noqa: E731 - the floats' values exactly
    tensors, actions = _run_to_alert(as_tensor, steps=range(1, 8))
    assert [r["step"] for r in tensors.records] == [4]  # steps 5-7 are still unread
    state = tensors.hook.state_dict()
    assert json.dumps(state["losses"]) == json.dumps(floats.hook.losses) and len(state["losses"]) == 7
    assert json.dumps(tensors.records) == json.dumps(floats.records)
    tensors.hook.before_step(8)  # the alert found by the read-back acts at the next step
    assert tensors.hook.after_optimizer_step(8, loss=torch.tensor(1.0), grad_norm=None, lr=1e-3) is Action.CHECKPOINT
    closing, _ = _run_to_alert(as_tensor, steps=range(1, 8))
    closing.hook.close()
    assert json.dumps(closing.records) == json.dumps(floats.records)


def test_resume_from_one_state_entry_continues_the_series_exactly():
    full = _Run(_config())
    full.steps(1, 16)
    first = _Run(_config())
    first.steps(1, 7)
    state = first.hook.state_dict()
    assert state["version"] == 3 and set(state) >= {"monitors", "detectors", "mols", "first_alert_step"}
    assert set(state["monitors"]) == {"attention"} and state["monitors"]["attention"]["version"] == 1
    resumed = _Run(_config(), weight=first.weight.clone(), start_step=7, state=state)
    resumed.steps(8, 16)
    expected = [r for r in full.records if r["step"] > 7]
    assert [r["step"] for r in resumed.records] == [r["step"] for r in expected]
    for got, want in zip(resumed.records, expected):  # same process, same computation: bit-equal
        assert got["metrics"] == want["metrics"] and got["alerts"] == want["alerts"]
    with pytest.raises(ValueError, match="version"):
        _Run(_config()).hook.load_state_dict({"version": 99})


def test_lr_fault_scales_the_lr_from_its_start_step():
    weight = torch.nn.Parameter(torch.zeros(3))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    injector = FaultInjector(FaultConfig(kind="lr", start=5, strength=4.0))
    run = _Run(_config(), optimizer=optimizer, extensions=[injector])
    seen = {}
    for step in range(1, 8):
        optimizer.param_groups[0]["lr"] = 0.1  # what the LR scheduler sets after every step
        run.hook.before_step(step)
        seen[step] = optimizer.param_groups[0]["lr"]
        run.hook.after_optimizer_step(step, loss=1.0, grad_norm=None, lr=0.1)
    assert [seen[s] for s in range(1, 5)] == [0.1] * 4
    assert all(math.isclose(seen[s], 0.4) for s in range(5, 8))
    assert injector.schedule.step == 7  # the attention modules of a fault read the same step


class _Recorder(Extension):
    """Writes down every call the hook makes, with the optimizer's lr at ``before_optimizer_step``."""

    name = "recorder"

    def __init__(self, calls, tag="recorder"):
        self.calls, self.name, self.restored = calls, tag, None

    def setup(self, hook, view, optimizer=None):
        self.calls.append((self.name, "setup", hook.families, optimizer is not None))

    def before_step(self, step):
        self.calls.append((self.name, "before_step", step))

    def before_optimizer_step(self, optimizer, step):
        self.calls.append((self.name, "before_optimizer_step", step))

    def after_optimizer_step(self, step, *, loss, grad_norm, lr):
        self.calls.append((self.name, "after_optimizer_step", step, loss))

    def state_dict(self):
        return {"calls": len(self.calls)}

    def load_state_dict(self, state):
        self.restored = state

    def close(self):
        self.calls.append((self.name, "close"))


def test_extensions_follow_the_lifecycle_in_registration_order_and_keep_their_state():
    calls = []
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    first, second = _Recorder(calls, "first"), _Recorder(calls, "second")
    run = _Run(_config(), optimizer=optimizer, extensions=[first])
    assert run.hook.extensions == [first]
    with pytest.raises(RuntimeError, match="before MechHook.setup"):
        run.hook.add_extension(second)
    run.steps(1, 2)
    run.hook.close()
    assert calls == [("first", "setup", ("attention",), True),
                     ("first", "before_step", 1), ("first", "before_optimizer_step", 1),
                     ("first", "after_optimizer_step", 1, _loss(1)),
                     ("first", "before_step", 2), ("first", "before_optimizer_step", 2),
                     ("first", "after_optimizer_step", 2, _loss(2)), ("first", "close")]
    state = run.hook.state_dict()
    assert state["extensions"] == {"first": {"calls": 8}}
    # resume: the entry goes to the extension of the same name, registered before or after the state is loaded
    hook = MechHook(_config(), extensions=[_Recorder([], "first")])
    hook.load_state_dict(state)
    late = _Recorder([], "second")
    hook.add_extension(late)
    assert hook.extensions[0].restored == {"calls": 8} and late.restored is None
    # an extension with no state adds nothing to the hook's entry (the entry of a run without one is unchanged)
    assert "extensions" not in _Run(_config(), extensions=[Extension()]).hook.state_dict()
    with pytest.raises(ValueError, match="already registered"):
        MechHook(_config(), extensions=[_Recorder([], "x"), _Recorder([], "x")])
    with pytest.raises(TypeError, match="expected an Extension"):
        MechHook(_config()).add_extension(object())


def test_the_base_extension_does_nothing_and_asks_for_nothing():
    import argparse

    parser = argparse.ArgumentParser()
    Extension.add_arguments(parser)
    assert Extension.from_args(parser.parse_args([])) is None
    base = Extension()
    assert base.global_batch(32, 4, 2) == 32 and base.layer_spec(4, "LayerNorm") is None
    assert base.describe() is None and base.summary() is None and base.state_dict() == {}


def test_setup_twice_and_unknown_router_request_are_errors():
    run = _Run(_config())
    with pytest.raises(RuntimeError, match="twice"):
        run.hook.setup(ModelView(), None)
    hook = MechHook(MechConfig(monitors=MonitorConfig(families=("router",))))
    with pytest.raises(ValueError, match="no MoE routers"):
        hook.setup(ModelView())


def _short_run(config, train_steps, spike_at=None, logging_rank=True):
    """A real hook on the one-layer view, set up and run for ``train_steps`` steps (the loss jumps by 50 from
    ``spike_at``): its records and the warnings it logged."""
    import logging

    records, warnings = [], []

    class _Collect(logging.Handler):
        def emit(self, record):
            if record.levelno >= logging.WARNING:
                warnings.append(record.getMessage())

    weight = torch.randn((HEADS + 2 * GROUPS) * HEAD_DIM, D_MODEL, generator=torch.Generator().manual_seed(0))
    hook = MechHook(config, train_steps=train_steps, sinks=CallbackSink(records.append))
    handler = _Collect()
    logging.getLogger("megatron_mech").addHandler(handler)
    try:
        hook.setup(ModelView(attention_layers=[AttentionLayer(0, weight, HEADS, GROUPS, HEAD_DIM)],
                             logging_rank=logging_rank))
        for step in range(1, train_steps + 1):
            hook.before_step(step)
            _update(weight, step)
            loss = 5.0 - 0.01 * step + (50.0 if spike_at is not None and step >= spike_at else 0.0)
            hook.after_optimizer_step(step, loss=loss, grad_norm=1.0, lr=1e-3)
    finally:
        logging.getLogger("megatron_mech").removeHandler(handler)
    return records, warnings


def test_settings_that_can_arm_nothing_are_warned_at_setup_naming_the_flag_and_the_steps():
    """An interval past the run evaluates nothing; warm-up + baseline + persistence beyond the run's evaluations
    leave only non-finite values to alert. Both are said once, up front, on the logging rank; a run whose
    detectors can alert (checked by making its last evaluation a loss spike) gets no warning."""
    # 6 steps, interval 10**20: no multiple of the interval in 1..6, so no record at all
    records, warnings = _short_run(_config(interval=10 ** 20), 6)
    assert records == []
    [message] = warnings
    assert "--mech-interval 100000000000000000000" in message and "6 training steps" in message, message
    assert _short_run(_config(interval=10 ** 20), 6, logging_rank=False)[1] == []  # the logging rank only
    # a warm-up of 100 evaluations in a run of 6 // 2 = 3: no baseline, a spike goes unnoticed
    late = MechConfig(monitors=MonitorConfig(families=("attention",), interval=2, qk_terms=("delta2",)),
                      detector=DetectorOverrides(warmup=100, baseline=3, persistence=1))
    records, warnings = _short_run(late, 6, spike_at=6)
    assert [r["step"] for r in records] == [2, 4, 6] and not any(r["alerts"] for r in records)
    [message] = warnings
    assert "--mech-detector-warmup" in message and "6 training steps" in message and "make 3 evaluations" in message
    assert "needs 104" in message, message  # 100 warm-up + 3 baseline + 1 out-of-band
    # each setting named as both kinds of run spell it: a Megatron flag and a DeepSpeed "mech" key
    for flag, key in (("--mech-detector-warmup", "mech.detector.warmup"),
                      ("--mech-detector-baseline", "mech.detector.baseline"),
                      ("--mech-detector-persistence", "mech.detector.persistence"),
                      ("--mech-interval", "mech.monitors.interval")):
        assert f"({flag}, {key})" in message, message
    # warm-up 0 + baseline 3 + persistence 1 = 4 evaluations: 6 steps (3) cannot alert, 8 steps (4) can
    records, warnings = _short_run(_config(interval=2), 6, spike_at=6)
    assert not any(r["alerts"] for r in records) and len(warnings) == 1 and "needs 4" in warnings[0]
    records, warnings = _short_run(_config(interval=2), 8, spike_at=8)
    assert warnings == [] and [a["family"] for a in records[-1]["alerts"]] == ["symptom"] and records[-1]["step"] == 8


def test_setup_logs_one_start_line_with_the_monitored_layers_interval_and_armed_from_step():
    """The logging rank says once, at setup, what the monitors watch (layer counts from the model view), how
    often, and the first step a baseline-relative alert can fire: (warm-up + baseline + persistence) of the
    earliest rule, times the interval. Other ranks say nothing."""
    import logging

    from megatron_mech.model_view import RouterView

    def start_lines(logging_rank, detector=None, layers_with_router=3):
        lines = []

        class _Collect(logging.Handler):
            def emit(self, record):
                if record.getMessage().startswith("[mech] monitors on:"):
                    lines.append(record.getMessage())

        weights = [torch.randn((HEADS + 2 * GROUPS) * HEAD_DIM, D_MODEL, generator=torch.Generator().manual_seed(i))
                   for i in range(3)]
        routers = [RouterView(layer, torch.randn(4, D_MODEL), 2, lambda observe: None)
                   for layer in range(layers_with_router)]
        config = MechConfig(monitors=MonitorConfig(families=("attention", "router")[:1 + bool(layers_with_router)],
                                                   interval=5),
                            detector=detector or DetectorOverrides())
        hook = MechHook(config, train_steps=1000, sinks=CallbackSink(lambda record: None))
        handler, mech_logger = _Collect(), logging.getLogger("megatron_mech")
        level = mech_logger.level
        mech_logger.addHandler(handler)
        mech_logger.setLevel(logging.INFO)
        try:
            hook.setup(ModelView(attention_layers=[AttentionLayer(i, w, HEADS, GROUPS, HEAD_DIM)
                                                   for i, w in enumerate(weights)],
                                 routers=routers, logging_rank=logging_rank))
        finally:
            mech_logger.removeHandler(handler)
            mech_logger.setLevel(level)
        return lines, hook

    lines, hook = start_lines(True)
    # the default detectors: the router's expert-load rule alerts on one evaluation, so warm-up 30 + baseline 20 +
    # persistence 1 = 51 evaluations, every 5 steps (no level rule is armed: the view offers no attention-logit
    # capture, and the busiest-expert rule is off by default)
    # the layer trend on the per-head Δ2 entropies: its rule's warm-up 30 + a window of 10 evaluations = step 200
    trend = ("; layer trend armed from step 200: attn/*/head*/delta2_entropy: a layer's median fall >= 1.5 log units "
             "over 10 evaluations")
    # the update-ratio jump shares the trend's warm-up and window, and judges the evaluation after them: step 205
    trend += ("; update-ratio jump armed from step 205: every layer's update ratio, in median, >= 0.693 log units "
              "above its own last 10 evaluations")
    assert lines == ["[mech] monitors on: 3 attention layers, 3 routers, every 5 steps; detectors armed from step "
                     "255 (warm-up 30 + baseline 20 + persistence 1 evaluations)" + trend]
    assert hook.armed_from_step == 255
    # a model without routers: the router rules cannot alert, the earliest rule is an attention or symptom rule,
    # 30 + 20 + 3 = 53 evaluations
    lines, hook = start_lines(True, layers_with_router=0)
    assert lines == ["[mech] monitors on: 3 attention layers, every 5 steps; detectors armed from step 265 (warm-up "
                     "30 + baseline 20 + persistence 3 evaluations)" + trend]
    assert hook.armed_from_step == 265
    assert hook.arming()["layer_trends"] == [{"rule": trend.split("; ")[1].split(": ", 1)[1], "armed_from_step": 200}]
    assert hook.arming()["update_ratio_jump"] == {"armed_from_step": 205, "level": math.log(2)}
    assert start_lines(False)[0] == []
    # with a busiest-expert level the router monitor's level rule is armed from the first evaluation, step 5
    lines, hook = start_lines(True, DetectorOverrides(expert_share_level=0.5))
    assert lines[0].endswith("(warm-up 30 + baseline 20 + persistence 1 evaluations); level rules armed from the "
                             "first evaluation (step 5): router/*/expert_share_excess > 0.5" + trend)
    assert hook.arming()["level_rules"] == {"armed_from_step": 5, "rules": ["router/*/expert_share_excess > 0.5"]}
    # switched off, and moved by its own warm-up (4 + 6 window evaluations, every 5 steps: step 50), not by the
    # baseline-relative rules'
    lines, hook = start_lines(True, DetectorOverrides(layer_trend_threshold=0))
    assert "layer trend" not in lines[0] and "layer_trends" not in hook.arming()
    lines, hook = start_lines(True, DetectorOverrides(update_ratio_jump=0))
    assert "update-ratio jump" not in lines[0] and "update_ratio_jump" not in hook.arming()
    lines, _ = start_lines(True, DetectorOverrides(warmup=4))
    assert "; layer trend armed from step 200: " in lines[0]
    lines, _ = start_lines(True, DetectorOverrides(layer_trend_warmup=4, layer_trend_window=6))
    assert "; layer trend armed from step 50: " in lines[0] and "over 6 evaluations" in lines[0]


def test_arming_of_a_run_that_reaches_the_armed_from_step():
    """warm-up 0 + baseline 3 + persistence 1 = 4 evaluations at interval 2: armed from step 8; a run of 8 steps
    gets there, one of 6 does not (only non-finite values could alert)."""
    assert _Run(_config(interval=2)).hook.armed_from_step == 8
    run = _Run(_config(interval=2))
    run.steps(1, 8)
    assert run.hook.arming() == {"armed_from_step": 8, "last_step": 8, "armed": True,
                                 "note": "run ended at step 8; detectors armed from step 8",
                                 "rule_overrides": {"warmup": 0, "baseline": 3, "persistence": 1},
                                 # the layer trend: its own warm-up 30 + a window of 10 evaluations, every 2 steps
                                 "layer_trends": [{"rule": "attn/*/head*/delta2_entropy: a layer's median fall >= "
                                                           "1.5 log units over 10 evaluations",
                                                   "armed_from_step": 80}],
                                 # the update-ratio jump: the same warm-up and window, then its first judged evaluation
                                 "update_ratio_jump": {"armed_from_step": 82, "level": math.log(2)}}
    run = _Run(_config(interval=2))
    run.steps(1, 6)
    assert run.hook.arming()["armed"] is False and "only non-finite values could alert" in run.hook.arming()["note"]
    # a baseline of 30: the baseline-relative rules arm at (0 + 30 + 1) · 2 = step 62, the layer trend (its warm-up
    # 0) at (0 + 10) · 2 = step 20, so a run ending at step 24 could have alerted through the trend, and says so
    config = _config(interval=2)
    config.detector = DetectorOverrides(warmup=0, baseline=30, persistence=1, layer_trend_warmup=0)
    run = _Run(config)
    run.steps(1, 24)
    assert run.hook.arming()["note"] == ("run ended at step 24, before the detectors were armed (step 62): only "
                                         "non-finite values and the layer trend (from step 20) could alert")


def test_the_armed_from_step_counts_only_the_rules_of_the_monitors_that_run():
    """An MoE model whose run watches the attention only: the router monitor does not run, so its expert-load rule
    (warm-up 30 + baseline 20 + persistence 1 = 51 evaluations) cannot alert first; the earliest rule is an
    attention or symptom rule, 30 + 20 + 3 = 53 evaluations, every 5 steps. The detectors hold no router rule."""
    from megatron_mech.model_view import RouterView

    weight = torch.randn((HEADS + 2 * GROUPS) * HEAD_DIM, D_MODEL, generator=torch.Generator().manual_seed(0))
    routers = [RouterView(layer, torch.randn(4, D_MODEL), 2, lambda observe: None) for layer in range(2)]
    hook = MechHook(MechConfig(monitors=MonitorConfig(families=("attention",), interval=5)), train_steps=1000,
                    sinks=CallbackSink(lambda record: None))
    hook.setup(ModelView(attention_layers=[AttentionLayer(0, weight, HEADS, GROUPS, HEAD_DIM)], routers=routers))
    assert [m.name for m in hook.monitors] == ["attention"]
    assert hook.armed_from_step == 53 * 5
    assert hook.arming()["armed_from_step"] == 265
    assert not any(rule.pattern.startswith("router/") for rule in hook.registry.rules)


def test_last_alerts_are_the_alerts_each_step_call_learnt_of():
    """``last_alerts`` holds what the latest ``after_optimizer_step`` learnt of: with tensors, the non-finite step 6
    waits on the device, so step 6's call learns nothing and step 8's learns step 6's alert (read back) beside its
    own evaluation's; a later step that only queues its values learnt nothing, and says so rather than repeating
    step 8's. The reference is the records: every alert of a record shows in the call that wrote it."""
    as_tensor = lambda v: torch.tensor(v, dtype=torch.float64)  # noqa: E731 - the floats' values exactly
    run = _Run(_config(interval=4))
    learnt = {}
    for step in range(1, 10):
        run.hook.before_step(step)
        _update(run.weight, step)
        run.hook.after_optimizer_step(step, loss=as_tensor(_blow_up_loss(step)), grad_norm=as_tensor(1.0 + step),
                                      lr=1e-3)
        learnt[step] = [(alert.step, alert.metric) for alert in run.hook.last_alerts]
    by_record = {r["step"]: [(a["step"], a["metric"]) for a in r["alerts"]] for r in run.records}
    assert sorted(by_record) == [4, 6, 8] and by_record[6]  # step 6's record, written at step 8's read-back
    assert learnt[6] == [] and learnt[8] == by_record[6] + by_record[8]
    assert learnt[9] == []  # step 9 only queued its values
