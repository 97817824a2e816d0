"""The Megatron-LM callback adapter drives MechHook exactly as a direct caller does.

Megatron-LM (``megatron.training``, whose ``CallbackManager`` fires the events) is not installed here, so a
minimal manager with the same ``register`` / ``fire`` contract and a context with the same fields stand in for
it; the hook, the monitor, the detectors and the sinks are the real ones."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from megatron_mech.config import DetectorOverrides, MechConfig, MonitorConfig
from megatron_mech.hook import Action, MechHook
from megatron_mech.adapters.megatron_core.lm_callbacks import register_mech_callbacks
from megatron_mech.model_view import ModelView
from megatron_mech.monitors.attention import AttentionLayer
from megatron_mech.records.sinks import CallbackSink


class _Manager:
    def __init__(self):
        self.events = {}

    def register(self, event, fn):
        self.events.setdefault(event, []).append(fn)

    def fire(self, event, ctx):
        for fn in self.events.get(event, ()):
            fn(ctx)


def _hook(records):
    config = MechConfig(monitors=MonitorConfig(families=("attention",), interval=2, qk_terms=("delta2",)),
                        detector=DetectorOverrides(warmup=0, baseline=3, persistence=1), on_alert="checkpoint")
    return MechHook(config, sinks=CallbackSink(records.append))


def _weight():
    return torch.randn(48, 16, generator=torch.Generator().manual_seed(0))


def _train(weight, step, before, after):
    before(step)
    with torch.no_grad():
        weight.add_(1e-2 * torch.randn(weight.shape, generator=torch.Generator().manual_seed(step)))
    return after(step, 5.0 + (40.0 if step >= 10 else 0.0))


def test_callbacks_equal_direct_hook_calls():
    view_of = lambda w: ModelView(attention_layers=[AttentionLayer(0, w, 2, 2, 8)])  # noqa: E731
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)

    direct_records, direct_weight = [], _weight()
    hook = _hook(direct_records)
    hook.setup(view_of(direct_weight), optimizer, start_step=0)
    direct = [_train(direct_weight, s, hook.before_step,
                     lambda step, loss: hook.after_optimizer_step(step, loss=loss, grad_norm=1.0, lr=0.1))
              for s in range(1, 13)]

    records, weight, manager = [], _weight(), _Manager()
    register_mech_callbacks(manager, _hook(records), build_view=lambda chunks: view_of(chunks[0]),
                            start_step=lambda: 0)
    ctx = SimpleNamespace(model=[weight], optimizer=optimizer, scheduler=None, loss_dict=None, grad_norm=None,
                          user_state={})
    manager.fire("on_train_start", ctx)

    def after(step, loss):
        ctx.loss_dict, ctx.grad_norm = {"lm loss": torch.tensor(loss)}, 1.0
        manager.fire("on_train_step_end", ctx)
        return ctx.user_state["mech_action"]

    via_callbacks = [_train(weight, s, lambda step: manager.fire("on_train_step_start", ctx), after)
                     for s in range(1, 13)]
    manager.fire("on_train_end", ctx)
    assert via_callbacks == direct and Action.CHECKPOINT in direct
    assert [r["step"] for r in records] == [r["step"] for r in direct_records] == [2, 4, 6, 8, 10, 12]
    assert [r["metrics"] for r in records] == [r["metrics"] for r in direct_records]
