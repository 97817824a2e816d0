"""``--mech-async``: the monitors' evaluation on the hook's worker thread, collected at a fixed boundary.

Real parts: a real AttentionEvaluator and ExpertEvaluator on weights the test updates like an optimizer would, the real
detectors and record layout (through a CallbackSink), the real worker thread. The reference for every record is
the same run with the evaluation inline (``--mech-async off``), compared as JSON text: bit for bit, same keys in
the same order. One process, no torch.distributed (the worker's groups are covered by the distributed tests in
tests/integration/megatron_core/test_async_evaluation.py)."""
from __future__ import annotations

import json
import logging
import math
import threading

import pytest
import torch

from megatron_mech.hook.async_evaluation import EvaluationWorker, WorkerFailure
from megatron_mech.config import DetectorOverrides, MechConfig, MonitorConfig
from megatron_mech.core.detect import DetectorRegistry, SeriesRule
from megatron_mech.hook import Action, MechHook
from megatron_mech.model_view import ModelView
from megatron_mech.monitors.attention import AttentionLayer
from megatron_mech.monitors.experts import ExpertLayer
from megatron_mech.monitors.protocol import Monitor
from megatron_mech.records.sinks import CallbackSink

pytestmark = pytest.mark.timeout(300)

HEADS, GROUPS, HEAD_DIM, D_MODEL = 2, 1, 8, 16
EXPERTS, FFN = 3, 12


class Summed(Monitor):
    """A split monitor: copies the sum of a weight on the training thread, evaluates it on whichever thread the
    hook uses (recorded in ``threads``); ``fail_at`` makes its evaluation raise at that step, ``block`` makes it
    wait on that event (a hang, until the test releases it)."""

    name = "summed"

    def __init__(self, weight, fail_at=None, block=None):
        self.weight, self.fail_at, self.block = weight, fail_at, block
        self.threads, self.evaluated = [], []

    def snapshot(self, step):
        return float(self.weight.double().sum())

    def evaluate(self, step, snapshot):
        self.threads.append(threading.current_thread())
        self.evaluated.append(step)
        if step == self.fail_at:
            raise RuntimeError("summed monitor broke")
        if self.block is not None:
            self.block.wait()
        return {"summed/value": snapshot}, {"summed/value": {"step": step}}


class Counted(Monitor):
    """A user's monitor implementing only ``observe``: runs on the training thread in both modes."""

    name = "counted"

    def __init__(self):
        self.threads = []

    def observe(self, step):
        self.threads.append(threading.current_thread())
        return {"counted/step": float(step)}, {}


class _Run:
    """A hook over one attention layer and one MoE layer of three experts, plus the given monitors."""

    def __init__(self, asynchronous, *, monitors=lambda weights: (), interval=2, on_alert="log", state=None,
                 start_step=0, timeout=300.0, weights=None):
        gen = torch.Generator().manual_seed(0)
        self.weights = weights or {
            "qkv": torch.randn((HEADS + 2 * GROUPS) * HEAD_DIM, D_MODEL, generator=gen),
            **{f"e{e}": torch.randn(FFN, D_MODEL, generator=gen) for e in range(EXPERTS)}}
        config = MechConfig(monitors=MonitorConfig(families=("attention",), interval=interval,
                                                   qk_terms=("delta2",), experts=True,
                                                   asynchronous="on" if asynchronous else "off",
                                                   async_timeout=timeout),
                            detector=DetectorOverrides(warmup=0, baseline=3, persistence=1), on_alert=on_alert)
        self.records = []
        self.monitors = list(monitors(self.weights))
        self.hook = MechHook(config, sinks=CallbackSink(self.records.append), monitors=self.monitors)
        view = ModelView(attention_layers=[AttentionLayer(0, self.weights["qkv"], HEADS, GROUPS, HEAD_DIM)],
                         experts=[ExpertLayer(1, [[self.weights[f"e{e}"]] for e in range(EXPERTS)], 0, EXPERTS)])
        if state is not None:
            self.hook.load_state_dict(state)
        self.hook.setup(view, None, start_step=start_step)
        assert self.hook.asynchronous is asynchronous

    def step(self, step, loss=None):
        self.hook.before_step(step)
        gen = torch.Generator().manual_seed(1000 + step)
        with torch.no_grad():
            for w in self.weights.values():
                w.add_(1e-2 * torch.randn(w.shape, generator=gen))
        return self.hook.after_optimizer_step(step, loss=5.0 - 0.01 * step if loss is None else loss,
                                              grad_norm=1.0 + step, lr=1e-3, extra={"n": step})

    def steps(self, first, last, loss=lambda step: None):
        return {step: self.step(step, loss(step)) for step in range(first, last + 1)}


def _text(records):
    return [json.dumps(r) for r in records]


def test_records_equal_the_inline_ones_byte_for_byte_and_land_at_the_end_of_the_next_step():
    inline = _Run(False, monitors=lambda w: (Summed(w["qkv"]), Counted()))
    inline.steps(1, 9)
    inline.hook.close()
    worker = _Run(True, monitors=lambda w: (Summed(w["qkv"]), Counted()))
    for step in range(1, 10):
        worker.step(step)
        # the record of an evaluation step s is written at the end of step s+1, naming s
        written = [r["step"] for r in worker.records]
        assert written == [s for s in range(2, step) if s % 2 == 0], (step, written)
    worker.hook.close()  # nothing in flight after step 9: the last record (8) came at step 9
    assert [r["step"] for r in inline.records] == [2, 4, 6, 8]
    assert any(k.startswith("attn/") for k in inline.records[-1]["metrics"])
    assert any(k.startswith("expert/") for k in inline.records[-1]["metrics"])
    assert _text(worker.records) == _text(inline.records)
    summed, counted = worker.monitors
    main = threading.main_thread()
    assert summed.threads and all(t is not main for t in summed.threads)   # evaluated on the worker
    assert counted.threads and all(t is main for t in counted.threads)     # observe-only: on the training thread
    assert worker.hook.async_report()["failure"] is None and worker.hook.async_report()["enabled"] is True


def test_the_alert_action_comes_at_the_end_of_the_next_step():
    """A non-finite loss on evaluation step 6: inline the action is returned by step 6, asynchronously by step 7;
    the records (with the alert) are the same."""
    nan_at_6 = lambda step: math.nan if step == 6 else None  # noqa: E731
    inline = _Run(False, on_alert="checkpoint")
    inline_actions = inline.steps(1, 8, nan_at_6)
    worker = _Run(True, on_alert="checkpoint")
    worker_actions = worker.steps(1, 8, nan_at_6)
    worker.hook.close()
    inline.hook.close()
    assert {s: a for s, a in inline_actions.items() if a is not Action.CONTINUE} == {6: Action.CHECKPOINT}
    assert {s: a for s, a in worker_actions.items() if a is not Action.CONTINUE} == {7: Action.CHECKPOINT}
    assert inline.hook.first_alert_step == worker.hook.first_alert_step == 6
    assert any(r["step"] == 6 and r["alerts"] for r in worker.records)
    assert _text(worker.records) == _text(inline.records)


def test_interval_one_collects_at_the_next_evaluation():
    inline = _Run(False, interval=1)
    inline.steps(1, 5)
    inline.hook.close()
    worker = _Run(True, interval=1)
    worker.steps(1, 5)
    assert [r["step"] for r in worker.records] == [1, 2, 3, 4]  # step 5 is still on the worker
    worker.hook.close()  # collects step 5
    assert _text(worker.records) == _text(inline.records)


def test_state_dict_with_an_evaluation_in_flight_collects_it_and_a_resume_gives_the_same_records():
    reference = _Run(True)
    reference.steps(1, 12)
    reference.hook.close()
    first = _Run(True)
    first.steps(1, 6)                       # step 6 is on the worker
    assert [r["step"] for r in first.records] == [2, 4]
    state = first.hook.state_dict()         # collects it first
    assert [r["step"] for r in first.records] == [2, 4, 6]
    weights = {k: v.clone() for k, v in first.weights.items()}
    resumed = _Run(True, state=state, start_step=6, weights=weights)
    resumed.steps(7, 12)
    resumed.hook.close()
    # experts re-snapshot after a resume (their state is not saved), so the first interval after it has no expert
    # series: compare with the uninterrupted run on everything but those
    def without_first_expert_interval(records):
        return [json.dumps({**r, "metrics": {k: v for k, v in r["metrics"].items()
                                             if not (r["step"] == 8 and k.startswith("expert/"))}})
                for r in records]
    assert (without_first_expert_interval(first.records + resumed.records)
            == without_first_expert_interval(reference.records))
    assert any(k.startswith("attn/") for k in resumed.records[0]["metrics"])  # snapshots were in the state


def _replayed_detectors(records, monitors):
    """The independent reference for a hook's detectors: a fresh registry of the rules the running ``monitors``
    bring, with the test's settings, fed the metrics of every record written, in order (the records are the run's
    record of truth)."""
    registry = DetectorRegistry.with_overrides(DetectorOverrides(warmup=0, baseline=3, persistence=1).as_rule_fields(), monitors)
    for record in records:
        registry.update(record["step"], {k: v for k, v in record["metrics"].items() if v is not None})
    return registry


@pytest.mark.parametrize("asynchronous", [True, False], ids=["beside", "inline"])
def test_a_monitor_that_raises_is_reported_and_the_monitors_stop_while_training_goes_on(caplog, asynchronous):
    """Beside training and inline alike: reported, the monitors off, training on; the failed step keeps a record
    with its loss and grad norm, judged, and is listed among the steps whose record is incomplete."""
    run = _Run(asynchronous, monitors=lambda w: (Summed(w["qkv"], fail_at=4),))
    with caplog.at_level(logging.ERROR, logger="megatron_mech"):
        actions = run.steps(1, 8)
    state = run.hook.state_dict()
    run.hook.close()
    assert all(a is Action.CONTINUE for a in actions.values())
    failure = run.hook.async_report()["failure"]
    assert failure["step"] == 4 and failure["monitor"] == "summed" and "summed monitor broke" in failure["error"]
    assert any("step 4" in r.message and "summed" in r.message for r in caplog.records)
    # step 4's record holds its loss and grad norm; later evaluation steps still judge them, inline
    assert [r["step"] for r in run.records] == [2, 4, 6, 8]
    assert set(run.records[1]["metrics"]) == set(run.records[-1]["metrics"]) == {"symptom/loss", "symptom/grad_norm"}
    assert run.records[1]["metrics"]["symptom/loss"] == 5.0 - 0.04
    assert run.hook.lost_record_steps == [4]
    assert run.monitors[0].evaluated == [2, 4]
    assert len(run.hook.losses) == 8
    # the detectors judged exactly what the records hold, step 4's loss and grad norm included
    assert state["detectors"]["detectors"] == _replayed_detectors(run.records, run.hook.monitors).state_dict()["detectors"]
    assert state["monitors"] == {}   # the monitors' entries are left out after a failure: they start afresh


class Slow(Monitor):
    """A user's monitor whose evaluation of ``slow_at`` waits until the test sets ``release`` (past the hook's
    timeout) and then returns a maximum attention logit far above the level rule's 100, with a loss-like series;
    every other evaluation returns quiet values."""

    name = "slow"

    def __init__(self, slow_at, release):
        self.slow_at, self.release = slow_at, release

    def snapshot(self, step):
        return step

    def rules(self, settings):  # its own level rule, armed from the first evaluation
        return [SeriesRule("slow/layer*/peak", direction="up", kind="level", level=100.0, persistence=1)]

    def evaluate(self, step, snapshot):
        if step == self.slow_at:
            self.release.wait()
            return {"slow/layer7/peak": 1e6}, {"slow/layer7/peak": {"layer": 7}}
        return {"slow/layer7/peak": 1.0}, {"slow/layer7/peak": {"layer": 7}}


def test_an_evaluation_given_up_at_its_timeout_changes_nothing_when_it_ends_later(caplog):
    """The evaluation of step 4 is given up at step 5 (timeout 1 s); the test then lets it finish, with a value
    that fires the monitor's own level rule, and waits for the worker thread to end. The hook's detectors, its alerts
    and its state must be exactly those of the records written (the reference: the records replayed through a
    fresh registry), with no trace of step 4's late value or alert, in any baseline."""
    release = threading.Event()
    run = _Run(True, monitors=lambda w: (Slow(4, release),), timeout=1)
    try:
        run.steps(1, 5)
        assert run.hook.async_report()["failure"]["step"] == 4
    finally:
        release.set()
    assert run.hook._evaluation.worker.close(timeout_s=60)  # the given-up evaluation has now run to its end
    run.steps(6, 10)
    state = run.hook.state_dict()
    run.hook.close()
    recorded_alerts = [(a["metric"], a["step"]) for r in run.records for a in r["alerts"]]
    assert [(a.metric, a.step) for a in run.hook.alerts] == recorded_alerts
    assert [r["step"] for r in run.records] == [2, 4, 6, 8, 10]
    assert [(a["metric"], a["step"]) for a in state["detectors"]["alerts"]] == recorded_alerts
    assert not any(step == 4 and metric.startswith("slow/") for metric, step in recorded_alerts)
    assert state["detectors"]["detectors"] == _replayed_detectors(run.records, run.hook.monitors).state_dict()["detectors"]
    assert run.hook.registry.state_dict()["detectors"] == state["detectors"]["detectors"]


def test_a_monitor_that_hangs_past_the_timeout_is_reported_and_close_returns():
    release = threading.Event()
    run = _Run(True, monitors=lambda w: (Summed(w["qkv"], block=release),), timeout=1)
    try:
        actions = run.steps(1, 5)   # step 2's evaluation never finishes: given up at step 3
        run.hook.close()
    finally:
        release.set()
    assert all(a is Action.CONTINUE for a in actions.values())
    failure = run.hook.async_report()["failure"]
    assert failure["step"] == 2 and "did not finish within 1 s" in failure["error"]
    assert [r["step"] for r in run.records] == [2, 4]
    assert run.monitors[0].evaluated == [2]


def test_close_returns_with_a_stuck_worker_and_reports_it():
    release = threading.Event()
    run = _Run(True, monitors=lambda w: (Summed(w["qkv"], block=release),), timeout=1)
    try:
        run.steps(1, 2)             # step 2 in flight, stuck
        run.hook.close()            # waits at most the timeout, then leaves the daemon thread behind
    finally:
        release.set()
    assert run.hook.async_report()["failure"]["step"] == 2


def test_worker_reports_a_raising_job_and_runs_nothing_before_collection():
    worker = EvaluationWorker(timeout_s=60)
    assert worker.collect() is None
    worker.submit(3, lambda: 7)
    with pytest.raises(RuntimeError, match="step 3 was not collected"):
        worker.submit(4, lambda: 8)
    assert worker.collect() == (3, 7)
    worker.submit(4, lambda: 1 / 0)
    with pytest.raises(WorkerFailure, match="step 4 raised ZeroDivisionError") as caught:
        worker.collect()
    assert caught.value.step == 4 and isinstance(caught.value.cause, ZeroDivisionError)
    assert worker.close()


@pytest.mark.parametrize("value, message", [("sometimes", "--mech-async"), (0, "--mech-async-timeout"),
                                            (math.inf, "--mech-async-timeout"), (1e-6, "--mech-async-timeout"),
                                            (0.5, "--mech-async-timeout"), (86400.5, "--mech-async-timeout"),
                                            (1e10, "--mech-async-timeout"), (1e308, "--mech-async-timeout"),
                                            (math.nan, "--mech-async-timeout")])
def test_bad_settings_are_refused_naming_the_flag(value, message):
    field = "asynchronous" if message == "--mech-async" else "async_timeout"
    with pytest.raises(ValueError, match=message):
        MonitorConfig(**{field: value})


def test_auto_is_off_for_a_model_on_the_cpu():
    config = MechConfig(monitors=MonitorConfig(families=("attention",)))
    hook = MechHook(config, sinks=CallbackSink(lambda r: None))
    weight = torch.zeros((HEADS + 2 * GROUPS) * HEAD_DIM, D_MODEL)
    hook.setup(ModelView(attention_layers=[AttentionLayer(0, weight, HEADS, GROUPS, HEAD_DIM)]))
    assert config.monitors.asynchronous == "auto" and hook.asynchronous is False


def test_a_stop_request_gives_the_evaluation_in_flight_up_instead_of_waiting_for_the_timeout():
    """A day's timeout, an evaluation that never returns, and a stop requested: the checkpoint's state comes back
    (a wait for the timeout would hang the test until pytest's own timeout), with the evaluation recorded as lost
    and the detectors of the last evaluation collected."""
    release = threading.Event()
    run = _Run(True, monitors=lambda w: (Summed(w["qkv"], block=release),), timeout=86400)
    run.steps(1, 1)
    reference = run.hook.registry.state_dict()
    try:
        run.steps(2, 2)                          # step 2's evaluation is stuck on the worker
        run.hook.stop_requested = lambda: True   # e.g. SIGTERM, as the entry point tells the hook
        state = run.hook.state_dict()
    finally:
        release.set()
    failure = run.hook.async_report()["failure"]
    assert failure["step"] == 2 and "a stop was requested" in failure["error"]
    assert state["monitors"] == {}
    replayed = _replayed_detectors(run.records, run.hook.monitors).state_dict()["detectors"]
    assert state["detectors"]["detectors"] == replayed != reference["detectors"]
    run.hook.close()
