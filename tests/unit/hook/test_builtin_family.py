"""A built-in family is one folder plus one registration line: the toy family of ``tests/toy_family`` (its monitor
and its own rules in one folder, its inputs in the model view's open slot) is added to ``BUILTIN_MONITORS`` and
nothing else. The hook then runs it, judges its series by its own rule, checkpoints it and its detectors, and a run
resumed from that checkpoint raises the same alert, under the family's name, as the run never interrupted.

Real parts: the real hook and detectors, real weights updated like an optimizer would, the hook's own record layout
(through a CallbackSink). The reference for the resume is the same run without the interruption (same process, same
computation: bit-equal)."""
from __future__ import annotations

import pytest
import torch
from toy_family import ToyUpdatesMonitor

import megatron_mech.monitors.registry as monitor_registry
from megatron_mech.config import DetectorOverrides, MechConfig, MonitorConfig
from megatron_mech.hook import MechHook
from megatron_mech.model_view import ModelView
from megatron_mech.records.sinks import CallbackSink

pytestmark = pytest.mark.timeout(300)

SHAPE, INTERVAL, STEPS, JUMP_STEP, CHECKPOINT_STEP = (12, 8), 2, 16, 14, 8
SERIES = "toy/layer0/update_norm"


@pytest.fixture
def registered(monkeypatch):
    """The registration line: the toy family's class appended to ``BUILTIN_MONITORS``, the one list of built-in
    families (the hook reads it when a run starts)."""
    monkeypatch.setattr(monitor_registry, "BUILTIN_MONITORS", (*monitor_registry.BUILTIN_MONITORS, ToyUpdatesMonitor))


def _update(weight, step):
    """An optimizer-like update: small every step, 100 times larger at ``JUMP_STEP``."""
    scale = 1.0 if step == JUMP_STEP else 1e-2
    with torch.no_grad():
        weight.add_(scale * torch.randn(weight.shape, generator=torch.Generator().manual_seed(1000 + step)))


def _run(weight, first, last, *, state=None):
    """Steps ``first`` to ``last`` of a hook watching ``weight`` through the toy family (the attention family has no
    layer here); returns the hook (closed when ``last`` is the run's last step) and its records."""
    records = []
    config = MechConfig(monitors=MonitorConfig(interval=INTERVAL),
                        detector=DetectorOverrides(warmup=0, baseline=3, persistence=1))
    hook = MechHook(config, sinks=CallbackSink(records.append))
    if state is not None:
        hook.load_state_dict(state, source="checkpoint iter_8")  # before setup: applied once the monitors exist
    hook.setup(ModelView(families={"toy_updates": [weight]}), None, start_step=first - 1)
    for step in range(first, last + 1):
        hook.before_step(step)
        _update(weight, step)
        hook.after_optimizer_step(step, loss=5.0 - 0.01 * step, grad_norm=1.0, lr=1e-3)
    if last == STEPS:
        hook.close()
    return hook, records


def _weight():
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(0))


def test_a_toy_family_registered_with_one_line_is_judged_by_its_own_rule_and_checkpointed(registered):
    reference, reference_records = _run(_weight(), 1, STEPS)
    assert "toy_updates" in [m.name for m in reference.monitors]
    alerts = [a for a in reference.alerts if a.family == "toy_updates"]
    assert [(a.metric, a.step, a.detail["layer"]) for a in alerts] == [(SERIES, JUMP_STEP, 0)]
    # the value is the update over the interval, measured here independently from the weights
    watched = _weight()
    for step in range(1, JUMP_STEP + 1):
        if step == JUMP_STEP - INTERVAL + 1:
            before = watched.clone()  # the weight at the previous evaluation step
        _update(watched, step)
    assert alerts[0].value == pytest.approx(float(torch.linalg.norm(watched - before)), rel=1e-6)

    weight = _weight()
    first, _ = _run(weight, 1, CHECKPOINT_STEP)
    state = first.state_dict()
    assert set(state["monitors"]["toy_updates"]["state"]) == {"previous"}  # the family's own entry
    assert any(name == SERIES for name in state["detectors"]["detectors"])  # and its series' detector
    resumed, resumed_records = _run(weight, CHECKPOINT_STEP + 1, STEPS, state=state)
    assert resumed.monitor("toy_updates").previous is not None
    assert [(a.metric, a.family, a.step, a.value, a.baseline) for a in resumed.alerts] == \
        [(a.metric, a.family, a.step, a.value, a.baseline) for a in reference.alerts]
    assert resumed_records == [r for r in reference_records if r["step"] > CHECKPOINT_STEP]
