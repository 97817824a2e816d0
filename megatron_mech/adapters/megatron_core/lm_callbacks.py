"""Megatron-LM's callback system onto :class:`~megatron_mech.hook.MechHook`.

Megatron-LM's training loop (``megatron.training``: ``Callback``, ``CallbackContext``, ``CallbackManager``) fires
``on_train_start``, ``on_train_step_start``, ``on_train_step_end`` and ``on_train_end`` with a context holding
the model chunks, the optimizer, the scheduler, the step's reduced losses and the gradient norm. Each event is
one hook call::

    from megatron.training.callbacks import CallbackManager
    manager = CallbackManager()
    register_mech_callbacks(manager, MechHook(MechConfig.from_flags(args), train_steps=args.train_iters))
    pretrain(..., callbacks=manager)

``on_train_step_end`` comes after ``scheduler.step()``, which the hook handles (it re-derives the lrs after
writing MoLS multipliers). The :class:`~megatron_mech.hook.Action` of a step is left in
``context.user_state["mech_action"]``; Megatron-LM's callbacks cannot save or stop the loop, so ``checkpoint``
and ``stop`` need the patch set (``patches/``). MoLS needs its param groups before the optimizer exists
(``hook.optimizer_overrides``), which callbacks cannot reach either: MoLS under Megatron-LM is the patch set's.
With pipeline parallelism only the last stage has the step's loss; other stages report NaN for it.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

from megatron_mech.adapters.megatron_core.master_weights import read_master_weights
from megatron_mech.hook import MechHook
from megatron_mech.optim import base_lr

__all__ = ["register_mech_callbacks"]


def _megatron_lm_start_step() -> int:
    from megatron.training import get_args

    return int(get_args().iteration)


def _megatron_lm_view(model_chunks):
    from megatron.training import get_args

    from megatron_mech.adapters.megatron_core.discovery import megatron_model_view

    return megatron_model_view(model_chunks, sequence_parallel=bool(getattr(get_args(), "sequence_parallel", False)))


def register_mech_callbacks(manager, hook: MechHook, *, build_view: Optional[Callable] = None,
                            start_step: Optional[Callable[[], int]] = None, loss_key: str = "lm loss") -> None:
    """Register the hook's lifecycle on a Megatron-LM ``CallbackManager`` (anything with ``register(event, fn)``).

    ``build_view(model_chunks)`` (default: :func:`~megatron_mech.adapters.megatron_core.discovery.megatron_model_view`)
    and ``start_step()`` (default: Megatron-LM's ``args.iteration`` after the checkpoint load) are read at
    ``on_train_start``; ``loss_key`` names the loss in ``context.loss_dict``."""
    build_view = build_view or _megatron_lm_view
    start_step = start_step or _megatron_lm_start_step
    done = {"steps": 0}

    def on_train_start(ctx):
        done["steps"] = int(start_step())
        view = read_master_weights(build_view(ctx.model), ctx.optimizer, hook.config.monitors.weights)
        hook.setup(view, ctx.optimizer, start_step=done["steps"], scheduler=ctx.scheduler)

    def on_train_step_start(ctx):
        hook.before_step(done["steps"] + 1)

    def on_train_step_end(ctx):
        done["steps"] += 1
        loss = (ctx.loss_dict or {}).get(loss_key)
        skipped = getattr(ctx, "skipped_iter", None)  # Megatron-LM's: the optimizer skipped the step
        ctx.user_state["mech_action"] = hook.after_optimizer_step(
            done["steps"], loss=float(loss) if loss is not None else math.nan,
            grad_norm=float(ctx.grad_norm) if ctx.grad_norm is not None else None, lr=base_lr(ctx.optimizer),
            skipped=bool(skipped) if skipped is not None else None)

    def on_train_end(ctx):
        hook.close()

    for event, fn in (("on_train_start", on_train_start), ("on_train_step_start", on_train_step_start),
                      ("on_train_step_end", on_train_step_end), ("on_train_end", on_train_end)):
        manager.register(event, fn)
