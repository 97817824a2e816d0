"""The hook's monitor list: every family (the built-in ones and a user's) goes through the same ``Monitor`` methods,
on the evaluation steps the hook decides, checkpointed as one versioned entry per monitor; states in the layout
written before that (the monitors' states as top-level keys, versions 1 and 2) still resume exactly.

Real parts throughout: a real AttentionEvaluator and ExpertEvaluator on weights the test updates like an optimizer
would, the real detectors, the hook's own record layout (through a CallbackSink). The reference for a resume is the
same run without the interruption (same process, same computation: bit-equal)."""
from __future__ import annotations

import pytest
import torch

import megatron_mech.monitors.registry as monitor_registry
from megatron_mech.config import DetectorOverrides, MechConfig, MonitorConfig
from megatron_mech.hook import MechHook, StateError
from megatron_mech.model_view import ModelView
from megatron_mech.monitors.attention import AttentionLayer
from megatron_mech.monitors.experts import ExpertLayer
from megatron_mech.monitors.protocol import Monitor
from megatron_mech.records.sinks import CallbackSink

pytestmark = pytest.mark.timeout(300)

HEADS, GROUPS, HEAD_DIM, D_MODEL = 2, 2, 8, 16
EXPERTS, FFN = 3, 12


class Toy(Monitor):
    """A toy family: counts its evaluations, records the count and which steps it was told about."""

    name = "toy"

    def __init__(self):
        self.count, self.observed, self.armed = 0, [], {}

    def before_step(self, step, evaluating):
        self.armed[step] = evaluating

    def observe(self, step):
        self.count += 1
        self.observed.append(step)
        return {"toy/count": float(self.count)}, {"toy/count": {"step": step}}

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        self.count = state["count"]


class _Run:
    """A hook over one attention layer (and, with ``experts``, one MoE layer of three experts)."""

    def __init__(self, *, experts=False, monitors=(), start_step=0, state=None, weights=None, interval=2):
        gen = torch.Generator().manual_seed(0)
        self.weights = weights or {
            "qkv": torch.randn((HEADS + 2 * GROUPS) * HEAD_DIM, D_MODEL, generator=gen),
            **{f"e{e}": torch.randn(FFN, D_MODEL, generator=gen) for e in range(EXPERTS)}}
        config = MechConfig(monitors=MonitorConfig(families=("attention",), interval=interval, qk_terms=("delta2",),
                                                   experts=experts),
                            detector=DetectorOverrides(warmup=0, baseline=3, persistence=1))
        self.records = []
        self.hook = MechHook(config, sinks=CallbackSink(self.records.append))
        for monitor in monitors:
            self.hook.add_monitor(monitor)
        view = ModelView(attention_layers=[AttentionLayer(0, self.weights["qkv"], HEADS, GROUPS, HEAD_DIM)],
                         experts=[ExpertLayer(1, [[self.weights[f"e{e}"]] for e in range(EXPERTS)], 0, EXPERTS)]
                         if experts else ())
        if state is not None:
            self.hook.load_state_dict(state, source="checkpoint iter_7")
        self.hook.setup(view, None, start_step=start_step)

    def steps(self, first, last):
        for step in range(first, last + 1):
            self.hook.before_step(step)
            gen = torch.Generator().manual_seed(1000 + step)
            with torch.no_grad():
                for w in self.weights.values():
                    w.add_(1e-2 * torch.randn(w.shape, generator=gen))
            self.hook.after_optimizer_step(step, loss=5.0 - 0.01 * step, grad_norm=1.0, lr=1e-3)


def test_a_user_monitor_registered_with_one_call_runs_on_the_evaluation_steps_and_is_checkpointed():
    toy = Toy()
    run = _Run(monitors=[toy])
    run.steps(1, 8)
    assert toy.observed == [2, 4, 6, 8]  # the hook's rule (multiples of the interval), not the monitor's
    assert toy.armed == {s: s % 2 == 0 for s in range(1, 9)}
    assert [r["metrics"]["toy/count"] for r in run.records] == [1.0, 2.0, 3.0, 4.0]
    # its series follow the built-in families' in every record (then the loss and grad norm symptoms)
    names = list(run.records[-1]["metrics"])
    assert names[-3:] == ["toy/count", "symptom/loss", "symptom/grad_norm"]
    assert "attn/layer0/head1/delta2_entropy" in run.records[-1]["metrics"]
    state = run.hook.state_dict()
    assert state["monitors"]["toy"] == {"version": 1, "state": {"count": 4}}

    resumed_toy = Toy()
    _Run(monitors=[resumed_toy], start_step=8, state=state, weights=run.weights)
    assert resumed_toy.count == 4


def test_a_builtin_family_is_one_class_and_one_registry_line(monkeypatch):
    # the registry line: the hook builds every family of the registry, in its order, with no branch of its own
    monkeypatch.setattr(monitor_registry, "BUILTIN_MONITORS", (*monitor_registry.BUILTIN_MONITORS, Toy))
    run = _Run()
    toy = run.hook.monitor("toy")
    assert isinstance(toy, Toy) and [m.name for m in run.hook.monitors] == ["attention", "toy"]
    run.steps(1, 4)
    assert toy.observed == [2, 4]
    assert run.hook.state_dict()["monitors"]["toy"] == {"version": 1, "state": {"count": 2}}


def test_add_monitor_refuses_a_second_name_a_non_monitor_and_a_late_registration():
    run = _Run(monitors=[Toy()])
    with pytest.raises(RuntimeError, match="before MechHook.setup"):
        run.hook.add_monitor(type("Other", (Toy,), {"name": "other"})())
    hook = MechHook(MechConfig(), monitors=[Toy()])
    with pytest.raises(ValueError, match="'toy' is already registered"):
        hook.add_monitor(Toy())
    with pytest.raises(ValueError, match="'attention' is already registered"):
        hook.add_monitor(type("Clash", (Toy,), {"name": "attention"})())
    with pytest.raises(TypeError, match="expected a Monitor"):
        hook.add_monitor(object())


def _version_2_layout(state: dict) -> dict:
    """The state as the hook wrote it before the monitor list (hook-state version 2): the attention and router
    monitors' own states at the top level, no "monitors" entry, every other key as it was."""
    old = {key: value for key, value in state.items() if key != "monitors"}
    old.update(version=2, attention=state["monitors"]["attention"]["state"], router=None)
    return old


def test_a_state_written_by_another_version_is_refused_by_name_before_anything_is_restored():
    """0.x releases carry no state across versions: a state in the version-2 layout (monitors at the top level) or
    of version 1 is refused, naming the checkpoint and saying so, not converted or half loaded."""
    first = _Run()
    first.steps(1, 7)
    old = _version_2_layout(first.hook.state_dict())
    older = {**{k: v for k, v in old.items() if k != "interval"}, "version": 1}
    for state, version in ((old, 2), (older, 1)):
        hook = MechHook(MechConfig(monitors=MonitorConfig(families=("attention",), interval=2)))
        with pytest.raises(StateError) as info:
            hook.load_state_dict(state, source="checkpoint iter_7")
        message = str(info.value)
        assert info.value.source == "checkpoint iter_7" and message.startswith("checkpoint iter_7: ")
        assert f"has version {version}" in message and "written by another megatron-mech version" in message
        assert "0.x releases do not carry states across versions" in message and "docs/versions.md" in message
        assert hook.losses == [] and hook.first_alert_step is None  # nothing of it restored


def test_a_monitor_entry_of_another_version_is_refused_naming_the_monitor_and_the_checkpoint():
    first = _Run()
    first.steps(1, 4)
    state = first.hook.state_dict()
    state["monitors"]["attention"]["version"] = 7
    with pytest.raises(StateError, match=r"checkpoint iter_7.*'attention' monitor's state has version 7"):
        _Run(start_step=4, state=state, weights=first.weights)


def test_the_expert_monitor_is_checkpointed_with_an_explicit_empty_state():
    full = _Run(experts=True)
    full.steps(1, 12)
    first = _Run(experts=True)
    first.steps(1, 8)
    state = first.hook.state_dict()
    assert state["monitors"]["experts"] == {"version": 1, "state": {}}
    resumed = _Run(experts=True, start_step=8, state=state,
                   weights={k: w.clone() for k, w in first.weights.items()})
    resumed.steps(9, 12)
    # no snapshot is saved: the resume snapshots at its start step (aligned), so step 10 is evaluated as in the
    # uninterrupted run
    expert_series = lambda record: {k: v for k, v in record["metrics"].items() if k.startswith("expert/")}  # noqa
    by_step = {r["step"]: r for r in full.records}
    assert [r["step"] for r in resumed.records] == [10, 12]
    for record in resumed.records:
        assert expert_series(record) and expert_series(record) == expert_series(by_step[record["step"]])


@pytest.mark.parametrize("name, message", [("", "a monitor needs a name"), ("  ", "a monitor needs a name"),
                                           (None, "a monitor needs a name"),
                                           ("detectors", "'detectors' is the hook's own"),
                                           ("output", "'output' is the hook's own")])
def test_add_monitor_refuses_an_empty_name_and_the_hooks_own_parts(name, message):
    monitor = Toy()
    monitor.name = name
    hook = MechHook(MechConfig(), sinks=CallbackSink(lambda record: None))
    with pytest.raises(ValueError, match=message):
        hook.add_monitor(monitor)


class Named(Monitor):
    """A user's monitor reporting the series it is given."""

    def __init__(self, name, series):
        self.name, self.series = name, series

    def observe(self, step):
        return {self.series: 0.5}, {}


@pytest.mark.parametrize("series, owner", [("attn/layer0/dwq_entropy", "the 'attention' monitor"),
                                           ("symptom/loss", "the hook's loss"),
                                           ("toy/count", "the 'toy' monitor")])
def test_a_series_another_monitor_reports_is_refused_at_the_first_evaluation_naming_both(series, owner):
    """A user's series named like a built-in one would replace it in the record and the detectors: the evaluation
    fails naming the series and both monitors (reported, the monitors off, training on), and no record holds the
    user's value under that name."""
    run = _Run(monitors=[Toy(), Named("mine", series)])
    run.steps(1, 4)
    run.hook.close()
    failure = run.hook.async_report()["failure"]
    assert failure["step"] == 2 and failure["monitor"] == "mine", failure
    assert f"monitor 'mine' reports the series {series!r}, which {owner} reports" in failure["error"]
    assert all(record["metrics"].get(series) != 0.5 for record in run.records)


class Holding(Monitor):
    """A user's monitor whose state holds an object of its own class."""

    name = "holding"

    def observe(self, step):
        return None

    def state_dict(self):
        return {"kept": [1.0, {"inner": Toy()}]}


def test_a_monitor_state_that_is_not_plain_data_is_refused_at_save_naming_the_monitor():
    run = _Run(monitors=[Holding()])
    run.steps(1, 2)
    with pytest.raises(ValueError, match=r"the 'holding' monitor's state_dict\(\) holds a Toy at "
                                         r"state\['kept'\]\[1\]\['inner'\]: a monitor's state must be plain data"):
        run.hook.state_dict()


def test_the_summary_breaks_the_monitor_time_down_by_part_with_every_running_monitors_captures():
    """A user monitor with captures in the forward passes (here 0.25 s, as its ``capture_seconds`` says) shows as
    ``toy_capture`` in the summary's ``monitor_breakdown``, whose parts add up to ``monitor_seconds``; a monitor may
    not take a name the breakdown gives a part."""

    class Capturing(Toy):
        capture_seconds = 0.25

    run = _Run(monitors=[Capturing()])
    run.steps(1, 4)
    run.hook.close()
    summary = run.hook.run_summary()
    assert summary.monitor_breakdown["toy_capture"] == 0.25
    assert summary.monitor_seconds == pytest.approx(sum(summary.monitor_breakdown.values()), rel=1e-12)
    for taken in ("master_weights", "toy_capture"):
        with pytest.raises(ValueError, match=f"the monitor name '{taken}' is the hook's own"):
            MechHook(MechConfig()).add_monitor(type("Taken", (Toy,), {"name": taken})())
