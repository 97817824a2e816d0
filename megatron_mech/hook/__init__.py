"""One object per rank that a trainer calls: :class:`MechHook`, a facade over parts that each own their data
(:mod:`megatron_mech.hook.mech_hook` lists them).

The hook owns everything megatron-mech does in a run: the monitors (a list, see "Monitors" below), MoLS, the detector
registry, the output sinks and the alert policy (``log | checkpoint | stop``). Anything else that must follow the
run's lifecycle (e.g. the studies' fault injection) is an :class:`Extension`, registered from outside. A framework
adapter is a translation onto its lifecycle::

    hook = MechHook(config, train_steps=T, lr_warmup_steps=W)      # every rank; config: MechConfig
    overrides = hook.optimizer_overrides(view)                     # (MoLS) before the optimizer exists
    optimizer = build_optimizer(..., overrides)                    # the framework's builder
    hook.attach_optimizer(optimizer)                               # (MoLS) before loading optimizer state or
                                                                   #   building the LR scheduler
    ... build the scheduler; load the checkpoint: hook.load_state_dict(ckpt["mech"]) ...
    hook.setup(view, optimizer, start_step=s0, scheduler=scheduler)  # after model, optimizer and checkpoint
    forward_step = hook.wrap_forward_step(forward_step)            # (MoLS) gradient statistics inside a step
    for step in range(s0 + 1, T + 1):
        hook.before_step(step)                                     # before the forward/backward
        ... forward/backward; optimizer.step(); scheduler.step() ...
        action = hook.after_optimizer_step(step, loss=..., grad_norm=..., lr=...)
        if action is not Action.CONTINUE: save; hook.checkpoint_saved(step, directory)
        if action is Action.STOP: break
    ckpt["mech"] = hook.state_dict()                               # per rank, one versioned entry
    hook.close()

**One step convention.** ``step`` is the number of the optimizer step being taken, counted from 1: ``before_step
(step)`` comes before its forward/backward, ``after_optimizer_step(step)`` after ``optimizer.step()``, so the
weights are then ``W_step``; ``start_step`` is the number of optimizer steps already done (0 for a fresh run, the
checkpoint's step on resume). Monitors evaluate on multiples of the interval, extensions see the same step numbers,
and MoLS's estimation window is placed on the same steps (``--mech-mols-window-start`` is a step; MoLS's
core counts ``iteration = step − 1``, Megatron-LM's ``iteration`` before the step, and the hook translates).

**MoLS touch points.** MoLS changes the optimizer, so it needs three calls before the training loop:
``optimizer_overrides`` (its per-module param groups, passed to the framework's optimizer builder),
``attach_optimizer`` (right after the optimizer exists: protects the param-group identity for checkpoint loads
and installs the gradient-statistics seam, so it must precede any optimizer-state load and the LR scheduler),
and ``wrap_forward_step`` (a micro-batch snapshot on one estimator route; the identity otherwise). Without
``--mech-mols`` all three are no-ops. The new multipliers are written in ``after_optimizer_step``; when a
``scheduler`` is given to ``setup`` the hook then re-derives the lrs with ``scheduler.step(0)`` (megatron-core's
``OptimizerParamScheduler``: same step count, same lrs, now with the new multipliers), so the trainer may call
``after_optimizer_step`` after ``scheduler.step()``, as Megatron-LM's callbacks do.

**Monitors.** Every monitor family is a :class:`~megatron_mech.monitors.protocol.Monitor`: the built-in ones
(:data:`~megatron_mech.monitors.registry.BUILTIN_MONITORS`: attention, experts, router, max attention logit) and a
user's own, registered with :meth:`MechHook.add_monitor` before ``setup``. The hook treats them alike: it builds
them in ``setup`` (a monitor decides there whether it runs), arms them in ``before_step``, asks them for metrics on
evaluation steps (:meth:`MechHook.is_evaluation_step`, the one rule), times them, merges their metrics over the
pipeline stages, and checkpoints each under its name (``"monitors"`` in :meth:`MechHook.state_dict`).

**Extensions.** The one public seam for code that is not the product and changes training (the studies' fault
injector is one): an :class:`Extension` subclass, given to the constructor (``MechHook(config, extensions=[ext])``)
or registered with :meth:`MechHook.add_extension` before ``setup``. The hook calls, in registration order:
``setup(hook, view, optimizer)`` at the end of :meth:`MechHook.setup`; ``before_step(step)`` at the end of
:meth:`MechHook.before_step`, then ``before_optimizer_step(optimizer, step)`` there when the hook knows the optimizer
(the lr is untouched by the forward/backward, so this is the place to change this step's lr);
``after_optimizer_step(step, loss=, grad_norm=, lr=)`` at the start of :meth:`MechHook.after_optimizer_step`;
``state_dict()`` / ``load_state_dict(state)`` inside the hook's state (under ``"extensions"``, keyed by
:attr:`Extension.name`, only when non-empty); ``close()`` from :meth:`MechHook.close`. The model-building points are
the adapters' to call, through :attr:`MechHook.extensions`: ``global_batch`` (once, before the data), ``check_model``
(the model's size, before anything is built), ``layer_spec`` (megatron-core: a transformer layer spec replacing the
local one) and ``prepare_model`` (the model the trainer calls, before the monitors look at it). An entry point
that offers an extension on its command line passes its class: :meth:`Extension.add_arguments` adds its flags,
:meth:`Extension.from_args` builds it (``None``: not asked for). Every method of the base class does nothing. An
extension changes training and is judged by nothing; a monitor only observes and is judged by the detectors
(:mod:`megatron_mech.extension`).

**Evaluation beside training** (``--mech-async``, :mod:`megatron_mech.hook.async_evaluation`). On an evaluation step
``after_optimizer_step`` only takes the monitors' snapshots (each monitor's ``snapshot``: copies of what it reads)
and hands their evaluation, the pipeline merge, the detectors and the alert agreement to a worker thread, which runs
the same code as the inline path, on duplicates of the groups. The result of step ``s`` is collected by the
training thread at ``after_optimizer_step(s + 1)`` (or earlier at ``state_dict``, ``close``, or the next
evaluation), waiting there if it is not ready: the record of ``s`` is then written, byte for byte the inline
one, and the alert's :class:`Action` returned by that call. The evaluation changes nothing the hook holds: it
judges on its own copy of the detectors and returns what it concluded, which the training thread merges when it
collects it in time, so an evaluation given up can never change the detectors, the alerts or the counters.

**A failed evaluation.** An evaluation in which a monitor raised (on any rank: agreed with the alert flag, in the
same all-reduce), or that did not finish within ``--mech-async-timeout`` (within
:data:`~megatron_mech.hook.async_evaluation.STOP_WAIT_SECONDS` once :attr:`MechHook.stop_requested`), is reported (a
log line naming the step, the monitor and the error; :meth:`MechHook.async_report` for the summary), inline or
beside training alike. Its step still gets a record, with its loss and grad norm judged and no monitor metrics
(:attr:`MechHook.lost_record_steps` lists it), and the monitors stop for the rest of the run on every rank,
training going on.

**Values on the device.** ``after_optimizer_step``'s ``loss`` and ``grad_norm`` may be floats or tensors (the value
is the tensor's mean, in float32 or the tensor's float64). A tensor given on a step that evaluates nothing stays where
it is: no host synchronisation. The hook reads every waiting value back in one transfer at the next step that needs
them: an evaluation step, the run's last step (``train_steps``), :meth:`MechHook.state_dict` or
:meth:`MechHook.close` (:mod:`~megatron_mech.hook.step_values`). The values and the steps they belong to are the
same either way; what a non-finite value on such a step triggers (its alert, its record, the :class:`Action`) comes
at that read-back, the alert and its record still carrying its own step. Floats are judged at once. A step the
optimizer skipped (``skipped=True``) is counted and named at the next evaluation step
(:mod:`~megatron_mech.hook.skipped_steps`).

**Collectives.** Every rank must call every lifecycle method at every step: the monitors reduce on evaluation
steps, and the alert decision is one tiny all-reduce there, so the returned :class:`Action` is identical on every
rank. A rank without MoE layers still joins the router reduction. Only the logging rank writes output.

**Console.** The hook logs to the ``megatron_mech`` logger: one start line at ``setup`` (what is monitored, how
often, the step the detectors are armed from) and one line per alert. When nothing would show those INFO lines (a
user's own script with no logging set up), the hook adds one stderr handler
(:func:`~megatron_mech.logs.ensure_visible`); logging the user or the entry point set up is used as it is.
"""
from __future__ import annotations

from megatron_mech.extension import Extension
from megatron_mech.hook.alert_policy import Action
from megatron_mech.hook.collectives import any_rank, any_ranks
from megatron_mech.hook.mech_hook import MechHook
from megatron_mech.hook.state import STATE_VERSION, StateError, naming_damaged_state
from megatron_mech.hook.timing import HOOK_TIMING_PARTS
from megatron_mech.monitors.protocol import Monitor

__all__ = ["HOOK_TIMING_PARTS", "Action", "Extension", "MechHook", "Monitor", "STATE_VERSION", "StateError",
           "any_rank", "any_ranks", "naming_damaged_state"]
