"""Resuming at another ``--mech-interval`` is refused by name: the hook's saved state carries the interval its
monitors evaluated at, and a run configured with another one would write records on a different grid, with ΔW
over a different number of steps, after those of the checkpoint. The states are the real hook's (a real attention
monitor on a weight updated like an optimizer would); the reference is the interval each run was configured with.
"""
from __future__ import annotations

import pytest
import torch

from megatron_mech.config import MechConfig, MonitorConfig
from megatron_mech.hook import MechHook
from megatron_mech.trainers.megatron_core.checkpoint import TRACKER, load_checkpoint
from megatron_mech.model_view import ModelView
from megatron_mech.monitors.attention import AttentionLayer
from megatron_mech.monitors.protocol import Monitor
from megatron_mech.records.sinks import CallbackSink

HEADS, GROUPS, HEAD_DIM, D_MODEL = 2, 2, 8, 16


def _hook(interval, weight, records, families=("attention",)):
    hook = MechHook(MechConfig(monitors=MonitorConfig(families=families, interval=interval, qk_terms=("delta2",))),
                    sinks=CallbackSink(records.append))
    hook.optimizer_overrides(ModelView())
    hook.attach_optimizer(None)
    return hook, ModelView(attention_layers=[AttentionLayer(0, weight, HEADS, GROUPS, HEAD_DIM)])


def _steps(hook, weight, first, last):
    for step in range(first, last + 1):
        hook.before_step(step)
        with torch.no_grad():
            weight.add_(1e-2 * torch.randn(weight.shape, generator=torch.Generator().manual_seed(step)))
        hook.after_optimizer_step(step, loss=1.0, grad_norm=1.0, lr=1e-3)


def _saved_run(interval=10, steps=10):
    """A run at ``interval`` for ``steps`` steps: its weight and its hook's state."""
    weight = torch.randn((HEADS + 2 * GROUPS) * HEAD_DIM, D_MODEL, generator=torch.Generator().manual_seed(0))
    hook, view = _hook(interval, weight, [])
    hook.setup(view, None, start_step=0)
    _steps(hook, weight, 1, steps)
    return weight, hook.state_dict()


def test_a_state_saved_at_another_interval_is_refused_naming_the_flag_both_values_and_the_checkpoint():
    weight, state = _saved_run(interval=10)
    assert state["interval"] == 10
    hook, _ = _hook(5, weight.clone(), [])
    with pytest.raises(ValueError) as info:
        hook.load_state_dict(state, source="checkpoint runs/a/iter_0000010")
    assert str(info.value).startswith("checkpoint runs/a/iter_0000010 was saved with --mech-interval 10 "
                                      "(mech.monitors.interval), this run has --mech-interval 5")


def test_a_state_saved_at_the_same_interval_resumes_and_evaluates_from_the_saved_snapshot():
    weight, state = _saved_run(interval=10)
    records = []
    hook, view = _hook(10, weight, records)
    hook.load_state_dict(state, source="checkpoint runs/a/iter_0000010")
    hook.setup(view, None, start_step=10)
    _steps(hook, weight, 11, 20)
    assert [r["step"] for r in records] == [20]  # the snapshot of step 10 came from the state: no skipped interval


def test_monitors_off_on_either_side_has_no_interval_to_mix():
    weight, state = _saved_run(interval=10)
    _hook(5, weight.clone(), [], families=())[0].load_state_dict(state)  # nothing monitored: nothing to mix
    hook, view = _hook(10, weight.clone(), [], families=())
    hook.setup(view, None, start_step=0)
    unmonitored = hook.state_dict()
    assert unmonitored["interval"] is None
    _hook(5, weight.clone(), [])[0].load_state_dict(unmonitored)


def test_megatron_core_checkpoint_at_another_interval_is_refused_naming_its_directory(tmp_path):
    weight, mech = _saved_run(interval=10)
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    directory = tmp_path / "iter_0000010"
    directory.mkdir()
    torch.save({"iteration": 10, "layout": {}, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "mech": mech, "mols_enabled": False}, directory / "rank0000.pt")
    (tmp_path / TRACKER).write_text("10")
    hook, _ = _hook(5, weight.clone(), [])
    with pytest.raises(ValueError, match=f"checkpoint file {directory / 'rank0000.pt'} was saved with --mech-interval 10 "):
        load_checkpoint(tmp_path, model, optimizer, scheduler=None, layout={}, hook=hook)


def test_a_leg_without_monitors_carries_the_interval_and_a_later_resume_at_another_one_is_refused():
    """Saved at interval 10, resumed with the monitors off at interval 5 (accepted: nothing monitored), then at
    interval 3: refused, naming the interval the detectors were warmed up at."""
    weight, state = _saved_run(interval=10)
    assert state["detectors"]["detectors"]  # the detectors warmed up at interval 10
    hook, view = _hook(5, weight.clone(), [], families=())
    hook.load_state_dict(state, source="checkpoint runs/a/iter_0000010")
    hook.setup(view, None, start_step=10)
    _steps(hook, weight, 11, 20)
    off_leg = hook.state_dict()
    assert off_leg["interval"] == 10
    with pytest.raises(ValueError, match="iter_0000020 was saved with --mech-interval 10 .* this run has "
                                         "--mech-interval 3"):
        _hook(3, weight.clone(), [])[0].load_state_dict(off_leg, source="checkpoint runs/a/iter_0000020")
    _hook(10, weight.clone(), [])[0].load_state_dict(off_leg)  # the carried interval resumes


class _Watching(Monitor):
    """A user's monitor that would run in any run it is given."""

    name = "watching"

    def observe(self, step):
        return {"watching/value": 1.0}, {}


def test_monitors_none_runs_no_monitor_at_all():
    """With --mech-monitors none, neither the max-logit monitor (which otherwise runs wherever the model captures
    its logits) nor a user's monitor runs: the records hold the loss and grad norm only."""
    weight = torch.randn((HEADS + 2 * GROUPS) * HEAD_DIM, D_MODEL, generator=torch.Generator().manual_seed(0))
    records = []
    hook, _ = _hook(2, weight, records, families=())
    hook.add_monitor(_Watching())
    view = ModelView(attention_layers=[AttentionLayer(0, weight, HEADS, GROUPS, HEAD_DIM)],
                     attention_logit_capture=[lambda recorder: None])
    hook.setup(view, None, start_step=0)
    _steps(hook, weight, 1, 4)
    hook.close()
    assert hook.monitors == []
    assert [r["step"] for r in records] == [2, 4]
    assert all(set(r["metrics"]) == {"symptom/loss", "symptom/grad_norm"} for r in records)
