"""The functions a patched Megatron-LM fork calls: every line the patch set adds is a call into this module.

All logic stays in the package; the patches (``megatron_lm_fork/patches/<tag>/``) only add these calls, at:

====================================  =====================================================================
call                                  place in the fork (core_v0.16.1 names)
====================================  =====================================================================
:func:`on_start`                      ``pretrain_gpt.py`` ``__main__``, before ``pretrain``: CPU shims
                                      (CPU-only machines), megatron-core fixes
:func:`extra_args_provider`           ``pretrain_gpt.py``: wraps the fork's own ``extra_args_provider``
                                      (``--mech-*``, ``--mech-mols*``, registered extensions' flags)
:func:`wrap_forward_step`             ``pretrain_gpt.py``: the ``forward_step`` given to ``pretrain``
:func:`optimizer_config_overrides`    ``setup_model_and_optimizer``: between ``get_megatron_optimizer_config``
                                      and ``get_megatron_optimizer`` (MoLS per-class param groups)
:func:`on_optimizer_built`            right after ``get_megatron_optimizer``, before ``load_checkpoint``
:func:`on_setup`                      end of ``setup_model_and_optimizer`` (model, optimizer, loaded state):
                                      the hook's ``setup`` (monitors, first snapshot)
:func:`on_train_start`                ``train``, after ``config.finalize_model_grads_func`` is set (MoLS)
:func:`before_step`                   start of ``train_step``
:func:`after_optimizer_step`          ``train_step``, between ``optimizer.step()`` and the scheduler step
:func:`log_to_writers`                ``training_log``, with Megatron's TensorBoard / W&B writers
:func:`add_checkpoint_state`          ``generate_state_dict`` (save side and load template)
:func:`note_checkpoint_contents`      ``load_checkpoint`` (``torch_dist``), once the common state is read
:func:`restore_checkpoint_state`      ``load_checkpoint``, after the optimizer and scheduler are loaded
====================================  =====================================================================

The end of training needs no patch line: :func:`on_start` wraps the fork's ``megatron.training.training.train``
(``pretrain`` looks it up there when it calls it), so when ``train`` returns, or ends the process with
``sys.exit`` as it does on ``--exit-interval``, a signal or ``--mech-on-alert stop``, :func:`on_train_end` reads back
the last values, closes the hook and writes the run's ``summary.json`` next to ``mech.jsonl`` (the same schema as
the megatron-core entry point's and DeepSpeed's, :mod:`megatron_mech.records.run_summary`).

Every call is a translation onto :class:`megatron_mech.hook.MechHook`'s lifecycle (one hook per process, made
from Megatron's parsed arguments on first use, :func:`get_hook`); one :class:`MechRun` per process (module
global ``RUN``) holds the hook and what passes between call sites. Every rank makes every call in the same
order: the monitors and MoLS issue their collectives there.

Extensions. A launcher that runs the fork's ``pretrain_gpt.py`` may offer hook extensions
(:class:`megatron_mech.hook.Extension` classes) with :func:`register_extension` before it starts: their flags
join the ``--mech-*`` ones and those the flags ask for are registered on the hook (the studies' fault launcher,
``megatron_mech.studies.megatron_lm_fault``, offers the ``--mech-fault*`` injector this way; the model gets its
attention through ``--spec megatron_mech.adapters.megatron_lm_fork.fault_spec layer_spec``).

``--mech-on-alert checkpoint|stop`` goes through Megatron-LM's own end-of-iteration path, so the checkpoint holds
the finished iteration (scheduler stepped, iteration counted). :func:`on_start` (or, with that flag, the first
:func:`get_hook`) wraps two functions of the fork's ``megatron.training.training`` (the ``train`` loop looks them
up there at each call): ``checkpoint_and_decide_exit`` — after Megatron's own decision for the alert step it saves
with ``save_checkpoint_and_time`` (with ``--save``; unless Megatron just saved that iteration) and, for ``stop``,
returns True, so ``train`` leaves its loop and exits as on ``--exit-interval``; and ``save_checkpoint_and_time``, which
tells the hook of every persistent save (``first_alert.json`` next to the alert's checkpoint names the last one before
it).

Ranks and writers. The monitors reduce their statistics over the model-parallel groups, so every rank holds
the same metrics; rank ``world_size - 1`` — where Megatron creates its TensorBoard and W&B writers — writes
``<output>/mech.jsonl`` and forwards the same records to those writers in ``training_log``.

Checkpoint state. Per-rank monitor state and the (rank-identical) MoLS state go under the key
``megatron_mech``: for ``--ckpt-format torch_dist`` one ``ShardedObject`` per rank (the pattern of
Megatron's rerun-state machine); for the legacy ``torch`` format, the state of the rank that writes the file
(expert-data-parallel rank 0, Megatron's legacy rule; only those ranks build the state dict, so no collective
is possible there), which every rank of that group loads. That is exact because the state is the same on
those ranks: weight snapshots of replicated (data-parallel) shards, all-reduced detector and MoLS state.
A checkpoint without the key (a run started before the patch) loads and the monitors start afresh.
"""
from __future__ import annotations

import logging
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch

__all__ = ["RUN", "MechRun", "STATE_KEY", "get_hook", "register_extension", "on_start", "extra_args_provider",
           "wrap_forward_step", "optimizer_config_overrides",
           "on_optimizer_built", "on_setup", "on_train_start", "before_step", "after_optimizer_step",
           "log_to_writers", "add_checkpoint_state", "note_checkpoint_contents", "restore_checkpoint_state",
           "on_train_end"]

logger = logging.getLogger(__name__)

STATE_KEY = "megatron_mech"
STATE_VERSION = 1
# Marker in the checkpoint's common (non-sharded) part: its ShardedObjects exist, so the load template may ask.
MARKER_KEY = "megatron_mech_state_version"


@dataclass
class MechRun:
    """What one process's call sites share. Users may read it, e.g. ``RUN.hook.alerts``."""

    hook: Any = None  # MechHook, from get_hook()
    view: Any = None  # the model's ModelView, from optimizer_config_overrides
    pending: List[dict] = field(default_factory=list)  # records not yet given to Megatron's writers
    restored: Optional[dict] = None  # this rank's hook state read by load_checkpoint, applied in on_setup
    checkpoint_has_state: bool = False  # load side: the checkpoint being loaded carries our state
    started: bool = False
    closed: bool = False  # the hook was closed at the end of training (on_train_end)
    alert_action: Any = None  # the first alert's (step, Action) when it asks to save or stop; acted on at its end
    saved_iteration: Optional[int] = None  # the iteration of Megatron's latest persistent save
    extension_types: List[type] = field(default_factory=list)  # offered by the launcher (register_extension)
    # (this rank's [loss sum, tokens], the tensor the hook was handed) of the steps whose loss is not combined yet
    waiting_losses: List[tuple] = field(default_factory=list)


RUN = MechRun()


def _args():
    from megatron.training import get_args

    return get_args()


def register_extension(extension_type: type) -> None:
    """Offer a :class:`~megatron_mech.hook.Extension` class (before the fork parses its arguments): its flags are
    added by :func:`extra_args_provider`, and the hook registers the extension its ``from_args`` builds."""
    if RUN.hook is not None:
        raise RuntimeError("register_extension: the hook already exists; register extensions before the run starts")
    if extension_type not in RUN.extension_types:
        RUN.extension_types.append(extension_type)


def get_hook():
    """This process's :class:`~megatron_mech.hook.MechHook`, made from Megatron's parsed arguments on first use
    (the ``--spec`` module may ask for it while the model is built), with the registered extensions the flags
    ask for."""
    if RUN.hook is None:
        from megatron_mech.adapters.megatron_core.megatron_args import lr_warmup_steps, train_steps
        from megatron_mech.config import MechConfig
        from megatron_mech.hook import MechHook

        args = _args()
        on_alert = getattr(args, "mech_on_alert", "log")
        if on_alert != "log" and not _install_alert_actions():
            raise ValueError(f"--mech-on-alert {on_alert}: this fork's megatron.training.training has no "
                             "checkpoint_and_decide_exit / save_checkpoint_and_time to save or stop through; use "
                             "--mech-on-alert log (alert callbacks: "
                             "megatron_mech.adapters.megatron_lm_fork.callsites.RUN.hook)")
        if getattr(args, "mech_mols", False) and getattr(args, "mech_mols_estimator", "two_batch") != "two_batch":
            raise ValueError("--mech-mols-estimator samples is not wired into the Megatron-LM patch set; use "
                             "two_batch (the default)")
        _install_save_combine()
        extensions = [e for e in (kind.from_args(args) for kind in RUN.extension_types) if e is not None]
        RUN.hook = MechHook(MechConfig.from_flags(args), train_steps=train_steps(args),
                            lr_warmup_steps=lr_warmup_steps(args), extensions=extensions)
    return RUN.hook


# --------------------------------------------------------------------------------------------- alert actions
_ALERT_ACTIONS_INSTALLED = False


def _install_alert_actions() -> bool:
    """Wrap the fork's ``checkpoint_and_decide_exit`` and ``save_checkpoint_and_time`` (see the module docstring);
    whether they are wrapped. Idempotent; a fork without them keeps ``--mech-on-alert log`` only (:func:`get_hook`
    says so)."""
    global _ALERT_ACTIONS_INSTALLED
    import functools
    import inspect

    from megatron.training import training

    from megatron_mech.hook import Action

    if _ALERT_ACTIONS_INSTALLED:
        return True
    decide = getattr(training, "checkpoint_and_decide_exit", None)
    save = getattr(training, "save_checkpoint_and_time", None)
    if decide is None or save is None:
        return False
    decide_signature, save_signature = inspect.signature(decide), inspect.signature(save)

    @functools.wraps(save)
    def save_checkpoint_and_time(*args, **kwargs):
        result = save(*args, **kwargs)
        bound = save_signature.bind(*args, **kwargs)
        bound.apply_defaults()
        if not bound.arguments["non_persistent_ckpt"]:
            _note_saved(int(bound.arguments["iteration"]))
        return result

    @functools.wraps(decide)
    def checkpoint_and_decide_exit(*args, **kwargs):
        should_exit = decide(*args, **kwargs)
        if RUN.alert_action is None:
            return should_exit
        (step, action), RUN.alert_action = RUN.alert_action, None
        bound = decide_signature.bind(*args, **kwargs).arguments
        iteration = int(bound["iteration"])
        if iteration != step:
            raise RuntimeError(f"megatron-mech: the alert of step {step} reached the end of iteration {iteration}")
        if _args().save and RUN.saved_iteration != iteration:  # same on every rank: the save is collective
            training.save_checkpoint_and_time(
                iteration, bound["model"], bound["optimizer"], bound["opt_param_scheduler"],
                bound["num_floating_point_operations_so_far"], bound["checkpointing_context"],
                train_data_iterator=bound["train_data_iterator"])
        if action is Action.STOP:
            logger.info("megatron-mech: stopping at iteration %d on the first alert (--mech-on-alert stop)", iteration)
            return True
        return should_exit

    training.save_checkpoint_and_time = save_checkpoint_and_time
    training.checkpoint_and_decide_exit = checkpoint_and_decide_exit
    _ALERT_ACTIONS_INSTALLED = True
    return True


def _note_saved(iteration: int) -> None:
    """Megatron saved a persistent checkpoint of ``iteration`` under ``--save``: the hook keeps the step (and on the
    first alert's step writes ``first_alert.json`` next to it)."""
    RUN.saved_iteration = iteration
    if RUN.hook is not None:
        from megatron.training.checkpointing import get_checkpoint_name

        RUN.hook.checkpoint_saved(iteration, get_checkpoint_name(_args().save, iteration, return_base_dir=True))


# --------------------------------------------------------------------------------------------- end of training
_TRAIN_END_INSTALLED = False


def _install_train_end() -> None:
    """Wrap the fork's ``megatron.training.training.train`` so that :func:`on_train_end` runs when it returns or
    exits the process with ``sys.exit`` (every rank leaves ``train`` the same way: its exit decision is agreed). A
    crash (any other exception) is left as it is: its ranks may be anywhere, so no collective is issued. A fork
    without ``train`` there is said once, in a warning. Idempotent."""
    global _TRAIN_END_INSTALLED
    import functools

    from megatron.training import training

    if _TRAIN_END_INSTALLED:
        return
    train = getattr(training, "train", None)
    if train is None:
        logger.warning("megatron-mech: this fork's megatron.training.training has no train function to wrap: the run "
                       "writes no summary.json (mech.jsonl holds every record and alert)")
        return

    @functools.wraps(train)
    def train_then_summarize(*args, **kwargs):
        try:
            result = train(*args, **kwargs)
        except SystemExit:
            on_train_end()
            raise
        on_train_end()
        return result

    training.train = train_then_summarize
    _TRAIN_END_INSTALLED = True


def on_train_end() -> None:
    """The end of ``train`` (every rank, collective): combine the waiting losses, close the hook (it reads back the
    last values and writes their records) and, on the logging rank, write ``summary.json`` beside ``mech.jsonl``
    (its alerts read from ``mech.jsonl``, the record of truth, so a resumed run's summary holds the alerts from
    before the resume). Nothing happens when the hook never started (``--skip-train``) or was closed already."""
    from pathlib import Path

    from megatron_mech.config import output_directory
    from megatron_mech.records.run_directory import JSONL, SUMMARY
    from megatron_mech.records.run_summary import write_run_summary
    from megatron_mech.records.sinks import read_alerts

    hook = RUN.hook
    if hook is None or RUN.view is None or RUN.closed:
        return
    _combine_waiting_losses()
    hook.close()
    RUN.closed = True
    if RUN.view.logging_rank:
        args = _args()
        output_dir = Path(output_directory(hook.config.output.dir, args.save))
        write_run_summary(output_dir / SUMMARY, hook.run_summary(alerts=read_alerts(output_dir / JSONL),
                                                                 train_iters=args.train_iters))


# --------------------------------------------------------------------------------------------- start, flags
def on_start() -> List[str]:
    """``pretrain_gpt.py``, before ``pretrain``: on a machine without CUDA apply the CPU shims for
    megatron-core and for the fork's training layer; everywhere apply megatron-core's no-TE fixes. Returns
    the names of what was applied."""
    from megatron_mech.adapters.megatron_core.fixes import apply_megatron_fixes
    from megatron_mech.adapters.megatron_lm_fork.training_cpu_shims import apply_training_cpu_shims

    applied = apply_training_cpu_shims() + apply_megatron_fixes()
    _install_alert_actions()
    _install_save_combine()
    _install_train_end()
    RUN.started = True
    if applied:
        logger.info("megatron-mech: applied %s", ", ".join(applied))
    early = _early_line(sys.argv[1:])
    if early and os.environ.get("RANK", "0") == "0":
        print(early, file=sys.stderr, flush=True)
    return applied


def _early_line(argv: List[str]) -> Optional[str]:
    """The line a run prints before Megatron's argument dump (hundreds of lines), so a user sees at once that the
    monitors are in: the interval and where the records go, read from the command line with the ``--mech-*``
    flags' own declaration. ``None`` when the flags do not parse (Megatron's parser then says why)."""
    import argparse

    from megatron_mech.adapters.megatron_core.megatron_args import add_arguments
    from megatron_mech.config import output_directory

    class _Quiet(argparse.ArgumentParser):
        def error(self, message):
            raise ValueError(message)

    parser = add_arguments(_Quiet(add_help=False, allow_abbrev=False))
    parser.add_argument("--save", default=None)
    try:
        flags, _ = parser.parse_known_args(argv)
    except ValueError:
        return None
    records = os.path.join(output_directory(flags.mech_output_dir, flags.save), "mech.jsonl")
    return (f"[mech] megatron-mech is on: monitors every {flags.mech_interval} steps, records in {records}; the "
            f"monitors' start line (layers, the step the detectors are armed from) comes at the first step")


def extra_args_provider(other=None):
    """An ``extra_args_provider`` adding every ``--mech-*`` flag (monitors, detectors, output, MoLS) and the
    registered extensions' flags after the fork's own ``other(parser)`` (if any)."""
    from megatron_mech.adapters.megatron_core.megatron_args import add_arguments

    def provider(parser):
        if other is not None:
            parser = other(parser)
        parser = add_arguments(parser)
        for kind in RUN.extension_types:
            kind.add_arguments(parser)
        return parser

    return provider


def wrap_forward_step(forward_step_func):
    """``pretrain_gpt.py``: the ``forward_step`` passed to ``pretrain``, seen through MoLS (which, on its
    micro-batch route, reads the gradient when the step's 2nd forward starts). MoLS is built later, inside
    ``pretrain``: the wrapper asks the hook at call time; without ``--mech-mols`` it calls straight through."""
    import functools

    cache = {}

    @functools.wraps(forward_step_func)
    def forward_step(*args, **kwargs):
        mols = RUN.hook.mols if RUN.hook is not None else None
        if mols is None:
            return forward_step_func(*args, **kwargs)
        if cache.get("mols") is not mols:
            cache["mols"], cache["fn"] = mols, RUN.hook.wrap_forward_step(forward_step_func)
        return cache["fn"](*args, **kwargs)

    return forward_step


# --------------------------------------------------------------------------------------------- optimizer
def optimizer_config_overrides(model, optimizer_config, config_overrides):
    """``setup_model_and_optimizer``: the ``config_overrides`` to pass to ``get_megatron_optimizer``.

    Without ``--mech-mols``: the fork's own, unchanged. With it: the fork's overrides (standard ones and any the
    fork adds, e.g. decoupled lr for embedding/output) plus one ``{"mols_module": class}`` override per
    parameter, so each module class gets its own groups. MoLS scales a group's own ``max_lr``/``min_lr``: with
    ``--decoupled-lr`` the embedding/output groups run at ``decoupled_lr × multiplier``. Overrides of one
    parameter that set the same key to different values make megatron-core raise ``ValueError``; ours use a
    key of their own and never conflict. Collective (every rank) with MoLS.
    """
    from megatron_mech.adapters.megatron_core.discovery import megatron_model_view
    from megatron_mech.adapters.megatron_core.mols import mols_config_overrides

    args = _args()
    hook = get_hook()
    RUN.view = megatron_model_view(model, sequence_parallel=bool(getattr(args, "sequence_parallel", False)),
                                   optimizer_config=optimizer_config, global_batch_size=args.global_batch_size,
                                   micro_batch_size=args.micro_batch_size)
    if hook.optimizer_overrides(RUN.view) is None:
        return config_overrides
    return mols_config_overrides(model, optimizer_config, hook.mols.taxonomy, extra_overrides=config_overrides)


def on_optimizer_built(model, optimizer) -> None:
    """Right after ``get_megatron_optimizer``, before any optimizer state is loaded: MoLS attaches to the
    param groups and makes the checkpoint load match them one-to-one (see :mod:`.param_group_loading`)."""
    from megatron_mech.adapters.megatron_lm_fork.param_group_loading import protect_for_this_version

    hook = get_hook()
    hook.attach_optimizer(optimizer)
    if hook.mols is not None:
        protect_for_this_version(optimizer)


# --------------------------------------------------------------------------------------------- set-up
def on_setup(model, optimizer, opt_param_scheduler) -> None:
    """End of ``setup_model_and_optimizer``: restore the state ``load_checkpoint`` read and set the hook up
    (monitors built, first snapshot; every rank, collective)."""
    from megatron_mech.records.sinks import CallbackSink

    if optimizer is None:  # --skip-train: no training steps to monitor
        return
    args = _args()
    hook = get_hook()
    start_step = int(getattr(args, "iteration", 0) or 0)
    if RUN.view is None:  # optimizer built without our overrides call (a fork's own optimizer path)
        from megatron_mech.adapters.megatron_core.discovery import megatron_model_view

        RUN.view = megatron_model_view(model, sequence_parallel=bool(getattr(args, "sequence_parallel", False)))
    if RUN.view.logging_rank:
        # mech.jsonl (the record of truth) here; Megatron's TensorBoard/W&B writers get the records in
        # training_log (log_to_writers).
        hook.open_sinks(start_step, fallback_dir=args.save, extra=[CallbackSink(RUN.pending.append)])
    if RUN.restored is not None:
        hook.load_state_dict(RUN.restored, source=f"checkpoint {args.load}")  # MoLS now, the monitors at setup
        RUN.restored = None
        if hook.mols is not None and opt_param_scheduler is not None:
            opt_param_scheduler.step(increment=0)  # the scheduler set lrs from max_lr before MoLS restored them
    from megatron_mech.adapters.megatron_core.master_weights import read_master_weights

    hook.setup(read_master_weights(RUN.view, optimizer, hook.config.monitors.weights), optimizer,
               start_step=start_step)


def on_train_start(model, optimizer, config, iteration: int) -> None:
    """``train``, after ``config.finalize_model_grads_func = finalize_model_grads`` (which replaced whatever was
    there): MoLS measures around that function, so it wraps the new one."""
    mols = get_hook().mols
    if mols is not None:
        mols.wrap_finalize_model_grads(config)


# --------------------------------------------------------------------------------------------- per step
def before_step(iteration: int) -> None:
    """Start of ``train_step(..., iteration)``: this step ends with optimizer step ``iteration + 1``."""
    get_hook().before_step(int(iteration) + 1)


def _step_loss(losses_reduced) -> tuple:
    """This step's loss as this rank holds it, before any reduction and without a host synchronisation:
    ``(pair, None)`` when the loss is the ratio of a ``[loss sum, tokens]`` pair still to be summed over
    :func:`_loss_group` (:func:`_combine_waiting_losses`), or ``(None, loss)`` when it is final here.

    The hook takes the loss to be identical on every rank (its between-evaluation check and its detectors act on
    it without a collective), but only the last pipeline stage computes it. With one stage: ``train_step``'s own
    reduction — the micro-batches' ``[loss sum, tokens]`` summed over the data-parallel (with context) group, in
    float32 as there; or the mean of the older per-micro-batch means, final as it is. With several stages the
    pair is summed over the default (world) group, in float64, the other stages adding zeros: the last stage's
    tensor-parallel ranks add identical pairs and its context-parallel ranks partial sums, so the ratio equals the
    data-parallel one (float64, so the tensor-parallel copies add exactly); an older per-micro-batch mean ``m``
    over ``n`` micro-batches enters as ``[m·n, n]``.
    """
    from megatron.core import parallel_state as mpu

    values = None  # the micro-batches' loss entries, on the last stage (the only one with a loss)
    if losses_reduced and mpu.is_pipeline_last_stage(ignore_virtual=True):
        key = next(iter(losses_reduced[0]))
        values = [x[key].detach().float().view(-1) for x in losses_reduced]
    if mpu.get_pipeline_model_parallel_world_size() > 1:
        from megatron_mech.core.sharded import collective_device

        pair = torch.zeros(2, dtype=torch.float64, device=collective_device())
        if values and values[0].numel() == 2:
            pair += torch.vstack(values).sum(dim=0).to(pair)
        elif values:
            pair[0] += torch.cat(values).mean().to(pair) * len(values)
            pair[1] += len(values)
        return pair, None
    if not values:
        return None, math.nan
    if values[0].numel() == 2:  # [sum, tokens] per micro-batch: a token-weighted mean over DP
        return torch.vstack(values).sum(dim=0), None
    return None, torch.cat(values).mean()


def _loss_group():
    """The group :func:`_step_loss`'s pairs are summed over: the world with several pipeline stages, else the
    data-parallel (with context) group."""
    from megatron.core import parallel_state as mpu

    if mpu.get_pipeline_model_parallel_world_size() > 1:
        return None
    return mpu.get_data_parallel_group(with_context_parallel=True)


def _combine_waiting_losses() -> None:
    """Sum the waiting steps' loss pairs over :func:`_loss_group` in one all-reduce (stacked) and write each step's
    ratio into the tensor the hook was handed for it, which the hook has not read yet (it reads the waiting values
    back at its next evaluation, at the run's last step and in ``state_dict``). Collective: every rank calls it at
    the same points — the steps the hook reads back at (:func:`after_optimizer_step`) and before every checkpoint
    save (:func:`_install_save_combine`) — and holds the same number of waiting steps there."""
    waiting, RUN.waiting_losses = RUN.waiting_losses, []
    if not waiting:
        return
    totals = torch.stack([pair for pair, _ in waiting])
    torch.distributed.all_reduce(totals, group=_loss_group())
    ratios = torch.where(totals[:, 1] > 0, totals[:, 0] / totals[:, 1], math.nan)
    for i, (_, loss) in enumerate(waiting):
        loss.copy_(ratios[i:i + 1])


_SAVE_COMBINE_INSTALLED = False


def _install_save_combine() -> None:
    """Wrap the fork's ``megatron.training.training.save_checkpoint`` (every save of the ``train`` loop and of
    ``pretrain`` goes through it, on every rank): the waiting losses are combined first, so the hook's
    ``state_dict`` — built on only some ranks for legacy checkpoints, where no collective is possible — reads final
    values. Idempotent."""
    global _SAVE_COMBINE_INSTALLED
    import functools

    from megatron.training import training

    if _SAVE_COMBINE_INSTALLED:
        return
    save = training.save_checkpoint

    @functools.wraps(save)
    def save_checkpoint(*args, **kwargs):
        _combine_waiting_losses()
        return save(*args, **kwargs)

    training.save_checkpoint = save_checkpoint
    _SAVE_COMBINE_INSTALLED = True


def _sync_params_if_gather_overlaps(model) -> None:
    """With ``--overlap-param-gather`` the model's params are all-gathered from the optimizer's shards only at
    the next forward: gather them now, synchronously, so the monitors read the updated weights. This is the
    gather Megatron's weight-hash check forces (``disable_forward_pre_hook(param_sync=True)``), called
    directly because the pre-hooks are not always registered here (Megatron removes them for the first step).
    Collective: every rank calls it on the same steps."""
    args = _args()
    if not (getattr(args, "overlap_param_gather", False) and getattr(args, "use_distributed_optimizer", False)):
        return
    for chunk in model:
        chunk.start_param_sync(force_sync=True)


def _group_lrs(optimizer) -> Dict[str, List[float]]:
    """``{class: sorted distinct lrs}`` of the MoLS-tagged param groups (the lrs this step used)."""
    from megatron_mech.adapters.megatron_core.mols import TAG
    from megatron_mech.optim import param_groups

    out: Dict[str, set] = {}
    for group in param_groups(optimizer):
        if group.get("params") and TAG in group:
            out.setdefault(group[TAG], set()).add(float(group["lr"]))
    return {cls: sorted(v) for cls, v in sorted(out.items())}


def after_optimizer_step(model, optimizer, iteration: int, losses_reduced, update_successful, grad_norm):
    """``train_step``, after ``optimizer.step()`` and before ``opt_param_scheduler.step``: MoLS writes the
    multipliers of the next step (the scheduler step right after applies them), the monitors evaluate step
    ``iteration + 1``. Returns the hook's :class:`~megatron_mech.hook.Action` (the same on every rank); a
    CHECKPOINT or STOP is carried out at the end of this iteration by ``checkpoint_and_decide_exit``.

    The hook (and its extensions) get the loss as a one-element device tensor; where it is combined over ranks
    (data parallelism, pipeline stages) it holds NaN until the next evaluation step, the run's last step or
    checkpoint save writes the combined value into it, before the hook reads it."""
    from megatron_mech.hook import Action
    from megatron_mech.optim import base_lr

    hook = get_hook()
    step = int(iteration) + 1
    if hook.is_evaluation_step(step):  # the monitors read the weights
        _sync_params_if_gather_overlaps(model)
    extra: Dict[str, Any] = {"update_successful": bool(update_successful)}
    if hook.mols is not None:
        extra["mols_group_lr"] = _group_lrs(optimizer)
    # The loss goes to the hook as a device tensor, combined over the ranks only on the steps the hook reads it
    # back at (one all-reduce for all the steps since the last): no host synchronisation and no collective between.
    pair, loss = _step_loss(losses_reduced)
    if pair is not None:
        loss = torch.full((1,), math.nan, dtype=pair.dtype, device=pair.device)  # written by the combine
        RUN.waiting_losses.append((pair, loss))
        if hook.is_evaluation_step(step) or step == hook.train_steps:  # as the hook reads back: the same everywhere
            _combine_waiting_losses()
    if grad_norm is not None and not isinstance(grad_norm, torch.Tensor):
        grad_norm = float(grad_norm)  # Megatron's norm is reduced over the model: the same on every rank
    action = hook.after_optimizer_step(step, loss=loss, grad_norm=grad_norm, lr=float(base_lr(optimizer)),
                                       extra=extra, skipped=not bool(update_successful))
    if action is not Action.CONTINUE:
        RUN.alert_action = (step, action)
    return action


# --------------------------------------------------------------------------------------------- logging
_WRITER_SINKS: Dict[int, Any] = {}


def log_to_writers(iteration: int, writer=None, wandb_writer=None) -> int:
    """``training_log``: hand the records of the steps since the last call to Megatron's TensorBoard and W&B
    writers (which exist on rank ``world_size - 1`` only; elsewhere the list is just cleared). Tags:
    ``mech/<metric>``, ``mech/alerts/<family>`` and ``mech/alerts``, at the hook's writer level
    (``--mech-writer-level``). Returns the number of records written."""
    from megatron_mech.records.sinks import TensorBoardSink, WandbSink

    records, RUN.pending[:] = list(RUN.pending), []
    if not records or (writer is None and wandb_writer is None):
        return 0
    sinks = []
    for target, cls, kw in ((writer, TensorBoardSink, "writer"), (wandb_writer, WandbSink, "run")):
        if target is not None:
            if id(target) not in _WRITER_SINKS:
                level = RUN.hook.config.output.writer_level if RUN.hook is not None else "full"
                _WRITER_SINKS[id(target)] = cls(**{kw: target}, level=level)
            sinks.append(_WRITER_SINKS[id(target)])
    for record in records:
        for sink in sinks:
            sink.write(record)
    return len(records)


# --------------------------------------------------------------------------------------------- checkpoint
def _rank_state() -> dict:
    if RUN.waiting_losses:  # a save that bypassed training.save_checkpoint: only a collective could finish them
        raise RuntimeError("megatron-mech: a checkpoint is being built while step losses wait to be combined over "
                           "the ranks; save through megatron.training.training.save_checkpoint, which combines them "
                           "on every rank first")
    return {"version": STATE_VERSION, "hook": RUN.hook.state_dict()}


def add_checkpoint_state(state_dict: dict, ckpt_format: str, loading: bool = False) -> dict:
    """``generate_state_dict``: add this rank's hook state under ``megatron_mech`` (save side), or the template
    to load it into (``loading=True``, ``torch_dist`` only, when the checkpoint has it). No collective. Returns
    ``state_dict``."""
    if RUN.hook is None:
        return state_dict  # not set up (e.g. a conversion tool): nothing of ours
    if ckpt_format == "torch_dist":
        from megatron.core.dist_checkpointing.mapping import ShardedObject

        if loading and not RUN.checkpoint_has_state:
            return state_dict
        state_dict[STATE_KEY] = ShardedObject(STATE_KEY, _rank_state(), (torch.distributed.get_world_size(),),
                                              (torch.distributed.get_rank(),), replica_id=0)
        state_dict[MARKER_KEY] = STATE_VERSION
    elif ckpt_format == "torch" and not loading:
        state_dict[STATE_KEY] = {"version": STATE_VERSION, "world_size": torch.distributed.get_world_size(),
                                 "state": _rank_state()}
    elif not loading:
        logger.warning("megatron-mech: checkpoint format %s is not supported; monitor/MoLS state not saved",
                       ckpt_format)
    return state_dict


def note_checkpoint_contents(common_state_dict: Optional[dict]) -> None:
    """``load_checkpoint`` (``torch_dist``), once the checkpoint's common part is read: whether it carries our
    state, so the load template asks for it only then."""
    RUN.checkpoint_has_state = bool(common_state_dict) and MARKER_KEY in common_state_dict


def restore_checkpoint_state(state_dict: Optional[dict], ckpt_format: str) -> bool:
    """``load_checkpoint``, after model/optimizer/scheduler are loaded: keep this rank's saved state for
    :func:`on_setup`. Returns whether state was found."""
    saved = (state_dict or {}).get(STATE_KEY)
    if saved is None:
        logger.info("megatron-mech: the checkpoint carries no monitor/MoLS state; monitors start afresh")
        return False
    if ckpt_format == "torch":
        if saved.get("world_size") != torch.distributed.get_world_size():
            logger.warning("megatron-mech: checkpoint from %s ranks, running on %s: monitor state not restored",
                           saved.get("world_size"), torch.distributed.get_world_size())
            return False
        saved = saved["state"]
    if not isinstance(saved, dict) or saved.get("version") != STATE_VERSION:
        raise ValueError(f"checkpoint key {STATE_KEY!r}: unsupported megatron-mech state "
                         f"(version {getattr(saved, 'get', lambda k: None)('version')})")
    RUN.restored = saved["hook"]
    return True
