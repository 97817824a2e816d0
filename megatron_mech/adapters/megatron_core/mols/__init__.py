"""megatron-core adapter for MoLS: per-module param groups, free gradient statistics, per-step multipliers.

Thin on purpose: :mod:`megatron_mech.core.mols` holds the estimate → α → schedule logic; this module finds the
parameters (one taxonomy, :mod:`megatron_mech.core.taxonomy`), builds the optimizer's per-class param groups,
measures per-class squared gradient norms through megatron-core's public seams (``config.finalize_model_grads_func``
and ``forward_step_func`` — no patch to megatron-core) and writes the multipliers into the param groups.

Call order in a training script (every rank; megatron-core ≥ 0.16)
------------------------------------------------------------------
:class:`megatron_mech.hook.MechHook` makes these calls for a trainer (its MoLS touch points
``optimizer_overrides``, ``attach_optimizer``, ``wrap_forward_step``, then ``after_optimizer_step``); used alone::

    model = DistributedDataParallel(config, ddp_config, GPTModel(...))        # model chunks, wrapped
    mols = MegatronMoLS.from_args(args, [model], optimizer_config)           # 1. collective (all ranks)
    optimizer = get_megatron_optimizer(optimizer_config, [model],
                                       config_overrides=mols.config_overrides)  # 2. per-class param groups
    config.finalize_model_grads_func = finalize_model_grads                  # (as usual)
    mols.install(config, optimizer)                                          # 3. AFTER 2 and the line above,
                                                                             #    BEFORE loading optimizer state
    scheduler = OptimizerParamScheduler(optimizer, init_lr=0.0, ...)         # 4. reads the groups' max/min_lr
    # resume:  optimizer.load_state_dict(...); mols.load_state_dict(ckpt["mols"]); scheduler.load_state_dict(...)
    #          (mols before the scheduler: the scheduler's load recomputes every lr from the groups' max_lr;
    #           if the scheduler was loaded first, call scheduler.step(0) after mols.load_state_dict)
    forward_step = mols.wrap_forward_step(forward_step)                      # 5. (micro-batch route; harmless else)
    for step in range(start_step + 1, train_steps + 1):                      # step: counted from 1, see below
        mols.sample_step(step, ...)              # only with the samples estimator (no-op otherwise)
        model.zero_grad_buffer(); optimizer.zero_grad()
        forward_backward_func(forward_step_func=forward_step, ...)           # finalize wrapper measures norms
        optimizer.step()
        mols.before_scheduler_step(step)                                     # 6. multipliers of step + 1
        scheduler.step(increment=...)
        log(mols.metrics(step))                                              # mols/snr/*, mols/alpha/*, ...
    ckpt["mols"] = mols.state_dict()                                         # identical on every rank

``step`` is the hook's step number: the optimizer step, counted from 1 (Megatron-LM's ``iteration`` passed to
``train_step`` counts the steps completed before it, one less).

**The next step's lr.** ``OptimizerParamScheduler.step()`` sets every group's ``lr`` from the group's
``max_lr``/``min_lr`` (0.16) for the *next* optimizer step. So the multipliers that step ``t + 1`` must use are
written by ``before_scheduler_step(t)`` — after ``optimizer.step()`` of step ``t`` and before ``scheduler.step()``.
Step 1 uses the lr set when the scheduler is built (multiplier 1: the estimate is not known yet). After that,
every group's lr is exactly ``base_lr(t) × multiplier(t, class)`` whenever the lr
warm-up starts from ``init_lr = 0`` (Megatron-LM's default ``--lr-warmup-init 0``) or has ended: the scheduler
computes ``lr = min_lr + coeff·(max_lr − min_lr)`` (or ``max_lr·t/warmup`` in warm-up) and we scale both
``max_lr`` and ``min_lr``; with ``init_lr > 0`` the warm-up part is ``init_lr + (α·max_lr − init_lr)·t/warmup``
instead (the shared ``init_lr`` is not per group in megatron-core).

The pieces, one responsibility each: :mod:`~megatron_mech.adapters.megatron_core.mols.param_groups` (per-class param
groups, multipliers, checkpoint identity), :mod:`~megatron_mech.adapters.megatron_core.mols.grad_norms` (gradient-norm
accounting across parallelism), :mod:`~megatron_mech.adapters.megatron_core.mols.estimator` (:class:`MegatronMoLS`: the
window, the two estimators, the per-step multipliers) and :mod:`~megatron_mech.adapters.megatron_core.mols.versions`
(megatron-core version branches).
"""
from megatron_mech.adapters.megatron_core.mols.estimator import ROUTES, MegatronMoLS, add_mols_arguments
from megatron_mech.adapters.megatron_core.mols.param_groups import (
    TAG,
    apply_multipliers,
    build_taxonomy,
    mols_config_overrides,
    protect_param_group_identity,
)
from megatron_mech.adapters.megatron_core.mols.versions import megatron_core_version, multiplier_mode
from megatron_mech.core.mols import default_window

__all__ = ["ROUTES", "TAG", "MegatronMoLS", "add_mols_arguments", "apply_multipliers", "build_taxonomy",
           "default_window", "megatron_core_version", "mols_config_overrides", "multiplier_mode",
           "protect_param_group_identity"]
