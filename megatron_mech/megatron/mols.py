"""megatron-core adapter for MoLS: per-module param groups, free gradient statistics, per-step multipliers.

Thin on purpose: :mod:`megatron_mech.core.mols` holds the estimate → α → schedule logic; this module finds the
parameters (one taxonomy, :mod:`megatron_mech.core.taxonomy`), builds the optimizer's per-class param groups,
measures per-class squared gradient norms through megatron-core's public seams (``config.finalize_model_grads_func``
and ``forward_step_func`` — no patch to megatron-core) and writes the multipliers into the param groups.

Call order in a training script (every rank; megatron-core ≥ 0.16)
------------------------------------------------------------------
::

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
    for iteration in range(start_iteration, train_iters):                    # iteration: 0-based, see below
        mols.sample_step(iteration, ...)         # only with --mech-mols-estimator samples (no-op otherwise)
        model.zero_grad_buffer(); optimizer.zero_grad()
        forward_backward_func(forward_step_func=forward_step, ...)           # finalize wrapper measures norms
        optimizer.step()
        mols.before_scheduler_step(iteration)                                # 6. multipliers of iteration + 1
        scheduler.step(increment=...)
        log(mols.metrics(iteration))                                         # mols/snr/*, mols/alpha/*, ...
    ckpt["mols"] = mols.state_dict()                                         # identical on every rank

``iteration`` is the number of optimizer steps completed before the current one (Megatron-LM's ``iteration``
passed to ``train_step``; in ``megatron_mech/pretrain_gpt.py``'s 1-based loop it is ``step - 1``).

**The off-by-one.** ``OptimizerParamScheduler.step()`` sets every group's ``lr`` from the group's
``max_lr``/``min_lr`` (0.16) for the *next* optimizer step. So the multipliers that iteration ``t + 1`` must use
are written by ``before_scheduler_step(t)`` — after ``optimizer.step()`` of iteration ``t`` and before
``scheduler.step()``. Iteration 0 uses the lr set when the scheduler is built (multiplier 1: the estimate is not
known yet). After that, every group's lr is exactly ``base_lr(t) × multiplier(t, class)`` whenever the lr
warm-up starts from ``init_lr = 0`` (Megatron-LM's default ``--lr-warmup-init 0``) or has ended: the scheduler
computes ``lr = min_lr + coeff·(max_lr − min_lr)`` (or ``max_lr·t/warmup`` in warm-up) and we scale both
``max_lr`` and ``min_lr``; with ``init_lr > 0`` the warm-up part is ``init_lr + (α·max_lr − init_lr)·t/warmup``
instead (the shared ``init_lr`` is not per group in megatron-core).

Param groups (:func:`mols_config_overrides`)
--------------------------------------------
Every parameter gets an extra override key ``{"mols_module": <class>}`` (matched by tensor identity), merged
with :func:`megatron.core.optimizer.get_standard_config_overrides` (no weight decay on biases and 1-D params;
decoupled lr for embedding/output) — so each module class has its own groups (× wd/no-wd × dense/expert), the
tag is copied into the group dict, and megatron-core's own behaviour is unchanged. ``install`` marks the groups
of scaled non-base classes ``default_config=False`` (Megatron-LM logs the lr of the first ``default_config``
group, which should stay the unscaled base lr). The tag survives
``ChainedOptimizer`` (dense + expert optimizers) and the distributed optimizer (whose ``param_groups`` are the
inner optimizer's groups over the fp32 shards, i.e. the dicts the scheduler writes).

**Checkpoint identity (a megatron-core 0.16.1 pitfall, handled by** :func:`protect_param_group_identity`,
**called by** ``install``). megatron-core matches saved to current param groups by the tuple
``(wd_mult, lr_mult, is_expert_parallel, is_decoupled_lr)`` only (``optimizer.py``
``_filter_and_reorder_param_groups`` and ``DistributedOptimizer.load_state_dict``). Groups that differ only in
other keys — ours, but also megatron's own ``decoupled_lr`` groups — collide: measured here, the plain
optimizer's ``load_state_dict`` then fails ("doesn't match the size of optimizer's group") and the distributed
optimizer's *silently* gives every group with the same tuple the dict of the last one (all tags become one
class). The protection wraps each leaf optimizer instance's ``load_state_dict`` (no change to megatron-core's
code): during the call it replaces ``lr_mult`` of every tagged group — current and in the state dict — by a
unique static identity (class, expert flag, base lrs and wd_mult) and restores the values afterwards. So
``install`` must run before any ``optimizer.load_state_dict``.

Gradient statistics with no extra samples (``--mech-mols-estimator two_batch``, default)
--------------------------------------------------------------------------------------
Per key (module classes, plus the fused QKV row blocks ``qkv_q/k/v``; the Q and K rows of ``linear_qkv`` count
under ``qk``, its V rows under ``vo``), per window iteration:

* **big batch** = the DP-reduced gradient, read just *after* the real ``finalize_model_grads``
  (``B_big`` = global batch). With the distributed optimizer the reduced gradient is reduce-scattered: each rank
  reads only the shard it owns (from the DDP grad buffers' bucket layout) and the shard norms are summed over DP.
* **small batch**, one of two routes (chosen once, ``route="auto"``):
  - ``"dp"`` (DP > 1 for every key's data-parallel group, ``overlap_grad_reduce=False``): each rank's *local*
    gradient just *before* the real finalize (the DP reduction), ``B_small = B/DP``. The squared norms of all DP
    replicas are averaged (the mean of n small-batch norms is still unbiased, and less noisy — the
    notes/experiments.md finding that using every small-batch norm beats using one). With gradient
    accumulation and DP > 1 this route is used and the micro-batch snapshot is not taken.
  - ``"microbatch"`` (DP = 1, or ``overlap_grad_reduce=True``; needs ≥ 2 micro-batches and no pipeline
    parallelism): ``wrap_forward_step`` snapshots the grad buffer when the 2nd forward of a step starts — it
    then holds exactly micro-batch 1's gradient (÷ num_microbatches, undone here) — ``B_small`` = micro-batch
    size; also averaged over DP replicas when DP > 1.
  With ``overlap_grad_reduce=True`` the DP reduction runs during the last backward, so the local gradient is not
  observable at finalize: the micro-batch route is used; without gradient accumulation that is impossible and
  ``MegatronMoLS`` raises, suggesting ``--mech-mols-estimator samples``.
* **Parallelism.** Each rank adds the squared norms of the gradient coordinates it owns uniquely and ONE world
  all-reduce of a ~50-float vector sums them (per step, window iterations only): TP-sharded parameters
  (``tensor_model_parallel``) count on every TP rank (disjoint shards); replicated ones (norms, router, RowParallel
  biases) count once (TP rank 0; expert-TP rank 0 for expert parameters); parameters whose local gradient is a
  *partial* sum over TP before finalize (sequence-parallel norms/router/biases, qk-layernorm; megatron-core's own
  ``_allreduce_non_tensor_model_parallel_grads`` rule) have their few gradient values all-reduced over TP first
  (a copy of those small tensors, pre-finalize only); expert parameters are summed over EP ranks (disjoint
  experts). Dense keys are then divided by DP and expert keys by expert-DP (mean over replicas / replicated
  reduced gradient). An expert rank's local gradient sums the mean-loss gradients of the EP/DP ranks whose tokens
  it received, so its small-batch value is rescaled by ``(expert_DP/DP)²`` and ``B_small = B/expert_DP``.
  The loss scale (fp16) is divided out. Context parallelism, per-token loss normalisation
  (``calculate_per_token_loss``) and tied embeddings under pipeline parallelism are rejected with a clear error;
  pipeline parallelism otherwise follows the same sums but is untested (megatron-core's PP does not run on
  these CPU machines).

The extra-sample reference (``--mech-mols-estimator samples``)
---------------------------------------------------------------
``sample_step(...)`` runs, at each window iteration, K = ``--mech-mols-samples`` extra forward/backward passes on
K separate micro-batches (the caller's iterator) through the real schedule with ``force_all_reduce=True``, keeps
each pass's per-key gradient (K copies of the gradient: expensive, a reference only), and feeds
:func:`megatron_mech.core.snr.sample_snr` (``batch_size = micro-batch × DP``); its additive components are summed over
ranks. It costs K extra forward/backward per window step, consumes dropout RNG, and leaves the grad buffers dirty
(call it before ``zero_grad_buffer``).

megatron-core 0.13–0.15
-----------------------
There ``get_megatron_optimizer`` has no ``config_overrides`` (one ``scale_lr_cond``/``lr_mult`` pair only), so it
cannot build per-class groups: :func:`mols_config_overrides` raises and groups tagged ``mols_module`` must come
from the Megatron-LM patch set. The scheduler there sets ``lr = schedule(group max_lr/min_lr) × group['lr_mult']``
(read in the 0.15.0 wheel), so :func:`apply_multipliers` writes the native per-group multiplier
``lr_mult = base_lr_mult × multiplier`` instead of ``max_lr``/``min_lr`` (which also scales a warm-up from
``init_lr > 0`` exactly). The version is detected by whether ``megatron.core.optimizer.optimizer_config.ParamKey``
exists. That branch is only unit-tested with a fake ``param_groups`` list here (no 0.13–0.15 install on these
machines).
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import math
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from megatron_mech.optim import leaf_optimizers
from megatron_mech.core.mols import MEASURED_KEYS, MoLSConfig, MoLSController, default_window
from megatron_mech.core.snr import sample_snr
from megatron_mech.core.taxonomy import (MODULE_CLASSES, ModuleTaxonomy, classify_parameters,
                                    fused_qkv_blocks, is_fused_qkv)

__all__ = ["MegatronMoLS", "add_mols_arguments", "apply_multipliers", "megatron_core_version",
           "mols_config_overrides", "multiplier_mode", "protect_param_group_identity"]

logger = logging.getLogger(__name__)

TAG = "mols_module"
ROUTES = ("auto", "dp", "microbatch")
_KEYS = MEASURED_KEYS
_KI = {k: i for i, k in enumerate(_KEYS)}
_NK = len(_KEYS)
_BLOCK_KEYS = {0: ("qk", "qkv_q"), 1: ("qk", "qkv_k"), 2: ("vo", "qkv_v")}

# ------------------------------------------------------------------------------------------------ versions
def megatron_core_version() -> str:
    try:
        from megatron.core.package_info import __version__
        return str(__version__)
    except Exception:  # pragma: no cover - very old / unusual installs
        return "unknown"


def multiplier_mode() -> str:
    """``"max_lr"`` for megatron-core ≥ 0.16 (``ParamKey`` config overrides; the scheduler reads per-group
    ``max_lr``/``min_lr``), ``"lr_mult"`` for 0.13–0.15 (the scheduler multiplies by ``group['lr_mult']``)."""
    try:
        from megatron.core.optimizer.optimizer_config import ParamKey  # noqa: F401
        return "max_lr"
    except ImportError:
        return "lr_mult"


# ------------------------------------------------------------------------------------------------ taxonomy
def _named_parameters(model_chunks) -> List[Tuple[str, torch.nn.Parameter]]:
    out = []
    multi = len(model_chunks) > 1
    for i, chunk in enumerate(model_chunks):
        for name, param in chunk.named_parameters():
            out.append((f"chunk{i}.{name}" if multi else name, param))
    return out


def build_taxonomy(model_chunks, extra_rules=None) -> ModuleTaxonomy:
    """The module taxonomy of the model chunks (names prefixed ``chunk{i}.`` when there are several chunks)."""
    return classify_parameters(_named_parameters(model_chunks), extra_rules=extra_rules)


def _class_by_id(taxonomy: ModuleTaxonomy) -> Dict[int, Tuple[str, str]]:
    """id(tensor) → (taxonomy name, class)."""
    if not taxonomy.parameters:
        raise ValueError("the taxonomy has no parameter tensors; build it with classify_parameters(...) on the "
                         "model (or pass taxonomy=None)")
    return {id(t): (n, taxonomy.classes[n]) for n, t in taxonomy.parameters.items()}


# ------------------------------------------------------------------------------------------------ param groups
def mols_config_overrides(model_chunks, optimizer_config, taxonomy: Optional[ModuleTaxonomy] = None,
                          extra_overrides: Optional[Mapping] = None) -> Dict:
    """``config_overrides`` for ``get_megatron_optimizer`` (megatron-core ≥ 0.16): the standard overrides
    (``get_standard_config_overrides(optimizer_config)``), ``extra_overrides`` (yours), and one
    ``ParamKey`` per module class adding ``{"mols_module": class}``, matched by tensor identity.

    Raises ``NotImplementedError`` on megatron-core 0.13–0.15 (see the module docstring) and ``ValueError`` when
    ``extra_overrides`` already uses the ``mols_module`` key.
    """
    if multiplier_mode() != "max_lr":
        raise NotImplementedError(
            f"megatron-core {megatron_core_version()}: get_megatron_optimizer has no config_overrides before 0.16 "
            "(one scale_lr_cond/lr_mult pair), so per-module param groups cannot be built through its API; build "
            "groups tagged 'mols_module' with the Megatron-LM patch set, apply_multipliers then sets lr_mult")
    from megatron.core.optimizer import get_standard_config_overrides
    from megatron.core.optimizer.optimizer_config import ParamKey, ParamWithNamePredicate

    taxonomy = taxonomy if taxonomy is not None else build_taxonomy(model_chunks)
    by_id = _class_by_id(taxonomy)
    ids_by_cls: Dict[str, set] = {}
    for _, param in _named_parameters(model_chunks):
        if id(param) not in by_id:
            raise ValueError("a model parameter is not in the taxonomy: build the taxonomy from these model chunks")
        ids_by_cls.setdefault(by_id[id(param)][1], set()).add(id(param))
    overrides = dict(get_standard_config_overrides(optimizer_config))
    for key, override in (extra_overrides or {}).items():
        if TAG in override:
            raise ValueError(f"extra_overrides must not set {TAG!r} (reserved for MoLS)")
        overrides[key] = override
    for cls in MODULE_CLASSES:
        if cls not in ids_by_cls:
            continue
        ids = frozenset(ids_by_cls[cls])
        pred = ParamWithNamePredicate(name=f"{TAG}_{cls}", fn=lambda p, n, ids=ids: id(p) in ids)
        overrides[ParamKey(with_name_predicate=pred)] = {TAG: cls}
    return overrides


def _param_groups(optimizer) -> List[dict]:
    if isinstance(optimizer, (list, tuple)):
        return list(optimizer)
    return list(optimizer.param_groups)


def _record_bases(group: dict) -> None:
    group.setdefault("mols_base_max", group.get("max_lr"))
    group.setdefault("mols_base_min", group.get("min_lr"))
    group.setdefault("mols_base_wd_mult", group.get("wd_mult", 1.0))
    group.setdefault("mols_base_lr_mult", group.get("lr_mult", 1.0))


def apply_multipliers(optimizer, multipliers: Mapping[str, float], base_max_lr: Optional[float] = None,
                      base_min_lr: Optional[float] = None, *, wd_multipliers: Optional[Mapping[str, float]] = None,
                      mode: Optional[str] = None) -> int:
    """Write per-class lr multipliers into every param group tagged ``mols_module``.

    ``optimizer``: a megatron optimizer (``ChainedOptimizer``, ``DistributedOptimizer``, ``FP32Optimizer``,
    ``Float16Optimizer…`` — all expose ``param_groups``, the dicts the scheduler writes), a torch optimizer, or a
    plain list of group dicts. Each group's base values are recorded on first use (``mols_base_max``,
    ``mols_base_min``, ``mols_base_wd_mult``, ``mols_base_lr_mult``), so repeated calls never compound.

    * ``mode="max_lr"`` (megatron-core ≥ 0.16, auto-detected): ``max_lr = base_max × m``,
      ``min_lr = base_min × m``, where the base is ``base_max_lr``/``base_min_lr`` when given, else the group's
      own recorded value (which keeps decoupled embedding/output lrs).
    * ``mode="lr_mult"`` (0.13–0.15): ``lr_mult = base_lr_mult × m``.

    ``wd_multipliers``: optional per-class factors for ``wd_mult`` (``base_wd_mult × f``; the
    ``scale_weight_decay=False`` compensation). The new values take effect at the scheduler's next ``step()``.
    Classes missing from ``multipliers`` get 1. Returns the number of groups written.
    """
    mode = mode or multiplier_mode()
    if mode not in ("max_lr", "lr_mult"):
        raise ValueError(f"mode must be 'max_lr' or 'lr_mult', got {mode!r}")
    n = 0
    for group in _param_groups(optimizer):
        cls = group.get(TAG)
        if cls is None:
            continue
        _record_bases(group)
        m = float(multipliers.get(cls, 1.0))
        if not (math.isfinite(m) and m > 0):
            raise ValueError(f"multiplier for {cls!r} must be positive and finite, got {m!r}")
        if mode == "max_lr":
            bmax = group["mols_base_max"] if base_max_lr is None else float(base_max_lr)
            bmin = group["mols_base_min"] if base_min_lr is None else float(base_min_lr)
            if bmax is None or bmin is None:
                raise ValueError(f"param group of {cls!r} has no max_lr/min_lr (megatron-core >= 0.16 groups have "
                                 "them); pass base_max_lr/base_min_lr or use mode='lr_mult'")
            group["max_lr"] = bmax * m
            group["min_lr"] = bmin * m
        else:
            group["lr_mult"] = group["mols_base_lr_mult"] * m
        if wd_multipliers is not None:
            group["wd_mult"] = group["mols_base_wd_mult"] * float(wd_multipliers.get(cls, 1.0))
        n += 1
    return n


# ------------------------------------------------------------------------------------------------ identity
def _identity(group: dict) -> tuple:
    return ("mols", group[TAG], bool(group.get("is_expert_parallel", False)),
            bool(group.get("is_decoupled_lr", False)),
            group.get("mols_base_wd_mult", group.get("wd_mult")), group.get("mols_base_lr_mult", group.get("lr_mult")),
            group.get("mols_base_max", group.get("max_lr")), group.get("mols_base_min", group.get("min_lr")),
            group.get("start_wd"), group.get("end_wd"))


def _saved_groups(obj, depth: int = 0):
    """Tagged param-group dicts inside a (possibly nested) optimizer state dict."""
    if depth > 6:
        return
    if isinstance(obj, dict):
        groups = obj.get("param_groups")
        if isinstance(groups, list):
            for g in groups:
                if isinstance(g, dict) and TAG in g:
                    yield g
        for k, v in obj.items():
            if k != "param_groups" and isinstance(v, (dict, list, tuple)):
                yield from _saved_groups(v, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            if isinstance(v, (dict, list, tuple)):
                yield from _saved_groups(v, depth + 1)


def _inner_groups(leaf) -> List[dict]:
    inner = getattr(leaf, "optimizer", None)
    if inner is not None and hasattr(inner, "param_groups"):
        return list(inner.param_groups)
    return list(leaf.param_groups)


def protect_param_group_identity(optimizer) -> None:
    """Make megatron-core's optimizer ``load_state_dict`` match MoLS param groups one-to-one (see the module
    docstring). Wraps each leaf optimizer *instance*'s ``load_state_dict`` once (idempotent); call it before
    loading optimizer state."""
    for leaf in leaf_optimizers(optimizer):
        if getattr(leaf, "_mols_identity_protected", False):
            continue
        original = leaf.load_state_dict

        def load_state_dict(state_dict, *args, _orig=original, _leaf=leaf, **kwargs):
            current = [g for g in _inner_groups(_leaf) if TAG in g]
            saved = list(_saved_groups(state_dict))
            cur_stash = [(g, g.get("lr_mult"), g.get("wd_mult")) for g in current]
            saved_stash = [(g, g.get("lr_mult"), g.get("wd_mult")) for g in saved]
            originals = {}
            for g in saved:
                originals[_identity(g)] = (g.get("lr_mult"), g.get("wd_mult"))
            for g in current + saved:
                ident = _identity(g)
                g["lr_mult"], g["wd_mult"] = ident, ident[4]
            try:
                result = _orig(state_dict, *args, **kwargs)
            finally:
                for g, lr_mult, wd_mult in cur_stash + saved_stash:
                    g["lr_mult"], g["wd_mult"] = lr_mult, wd_mult
            for g in _inner_groups(_leaf):  # the loaded groups carry the saved identity: restore saved values
                ident = g.get("lr_mult")
                if isinstance(ident, tuple) and ident[:1] == ("mols",):
                    if ident not in originals:
                        raise RuntimeError(f"MoLS: loaded param group {ident} has no saved counterpart")
                    g["lr_mult"], g["wd_mult"] = originals[ident]
            return result

        leaf.load_state_dict = load_state_dict
        leaf._mols_identity_protected = True


# ------------------------------------------------------------------------------------------------ gradient norms
class _Entry:
    __slots__ = ("param", "name", "key", "fused", "labels", "expert", "counted", "tp_reduce", "owned", "rows",
                 "cols")


def _row_sq(grad2d: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(grad2d, dim=1, dtype=torch.float64) ** 2


def _owned_row_sq(flat: torch.Tensor, lo: int, hi: int, cols: int) -> Tuple[int, torch.Tensor]:
    """Per-row squared sums of ``flat[lo:hi]`` for a [rows, cols] tensor: (first row, sums)."""
    r0, r1 = lo // cols, (hi - 1) // cols
    out = torch.zeros(r1 - r0 + 1, dtype=torch.float64, device=flat.device)
    a = -(-lo // cols) * cols  # first full-row start ≥ lo
    b = (hi // cols) * cols    # last full-row end ≤ hi
    if a >= b:  # no full row: the slice sits inside one or two rows
        mid = min(hi, (r0 + 1) * cols)
        out[0] += flat[lo:mid].double().pow(2).sum()
        if mid < hi:
            out[-1] += flat[mid:hi].double().pow(2).sum()
        return r0, out
    if lo < a:
        out[0] += flat[lo:a].double().pow(2).sum()
    full = flat[a:b].view(-1, cols)
    out[a // cols - r0: b // cols - r0] += _row_sq(full)
    if b < hi:
        out[-1] += flat[b:hi].double().pow(2).sum()
    return r0, out


class _GradNormReader:
    """Per-key contributions of this rank to the squared gradient norms (see the module docstring)."""

    def __init__(self, model_chunks, taxonomy: ModuleTaxonomy, model_config):
        from megatron.core import parallel_state as ps

        self.tp_size = ps.get_tensor_model_parallel_world_size()
        tp_rank = ps.get_tensor_model_parallel_rank()
        self.tp_group = ps.get_tensor_model_parallel_group() if self.tp_size > 1 else None
        by_id = _class_by_id(taxonomy)
        cfg = model_config
        heads, groups = cfg.num_attention_heads, cfg.num_query_groups or cfg.num_attention_heads
        head_dim = cfg.kv_channels or cfg.hidden_size // cfg.num_attention_heads
        h_local, g_local = heads // self.tp_size, max(1, groups // self.tp_size)
        self.entries: List[_Entry] = []
        self.device = None
        self.dist_opt = bool(getattr(model_chunks[0].ddp_config, "use_distributed_optimizer", False))
        self.shards = {False: 1, True: 1}
        etp_rank = None
        for chunk in model_chunks:
            names = {id(p): n for n, p in chunk.named_parameters()}
            buffers = [(b, False) for b in getattr(chunk, "buffers", [])]
            buffers += [(b, True) for b in getattr(chunk, "expert_parallel_buffers", [])]
            for buf, expert_buf in buffers:
                self.device = buf.grad_data.device
                if self.dist_opt:
                    self.shards[expert_buf] = buf.data_parallel_world_size
                for param in buf.params:
                    if id(param) not in by_id:
                        raise ValueError(f"parameter {names.get(id(param))!r} is not in the taxonomy")
                    tax_name, cls = by_id[id(param)]
                    e = _Entry()
                    e.param, e.name = param, tax_name
                    e.expert = not getattr(param, "allreduce", True)
                    replicated = not getattr(param, "tensor_model_parallel", False)
                    if e.expert and replicated:
                        if etp_rank is None:
                            etp_rank = ps.get_expert_tensor_parallel_rank()
                        e.counted = etp_rank == 0
                    else:
                        e.counted = (not replicated) or tp_rank == 0
                    e.tp_reduce = None
                    if self.tp_size > 1 and not e.expert:
                        if getattr(param, "average_gradients_across_tp_domain", False):
                            e.tp_reduce = "avg"
                        elif (getattr(cfg, "sequence_parallel", False) and getattr(param, "sequence_parallel", False)) \
                                or (getattr(cfg, "qk_layernorm", False)
                                    and ("q_layernorm" in tax_name or "k_layernorm" in tax_name)):
                            e.tp_reduce = "sum"
                        if e.tp_reduce is not None:
                            e.counted = tp_rank == 0
                    e.fused = cls == "qk" and is_fused_qkv(tax_name)
                    e.key = _KI[cls]
                    e.rows = param.shape[0]
                    e.cols = int(param.numel() // max(1, param.shape[0])) if param.dim() else 1
                    e.labels = None
                    if e.fused:
                        # the row layout of weight and bias alike: split the row indices as a 1-D "bias"
                        blocks = fused_qkv_blocks(tax_name, torch.arange(e.rows, dtype=torch.float64), h_local,
                                                  g_local, head_dim)
                        labels = torch.empty(e.rows, dtype=torch.long)
                        for lab, blk in enumerate(("q", "k", "v")):
                            labels[blocks[blk].reshape(-1).long()] = lab
                        e.labels = labels.to(buf.grad_data.device)
                    start, end, bucket_id = buf.param_index_map[param]
                    e.owned = (0, end - start)
                    if self.dist_opt:
                        bucket = buf.buckets[bucket_id]
                        shard = bucket.grad_data.numel() // buf.data_parallel_world_size
                        r = buf.data_parallel_group.rank()
                        lo_b = bucket.offset + r * shard
                        lo, hi = max(start, lo_b) - start, min(end, lo_b + shard) - start
                        e.owned = (lo, hi) if hi > lo else (0, 0)
                    self.entries.append(e)
        if self.device is None:
            raise ValueError("no DDP grad buffers found: wrap the model chunks in megatron-core's "
                             "DistributedDataParallel before building MegatronMoLS")
        self.sp_entries = [e for e in self.entries if e.tp_reduce is not None]

    # -- presence: param counts per class and per key, dense/expert (local; summed over the world by the caller)
    def presence(self) -> torch.Tensor:
        """[2 + 2, NK]: rows 0/1 = dense/expert entry counts per key; row 2 = fused-QKV count (col 0); row 3 =
        param counts per class of the taxonomy (first len(MODULE_CLASSES) columns)."""
        out = torch.zeros(4, _NK, dtype=torch.float64)
        for e in self.entries:
            if e.fused:
                for lab in range(3):
                    for k in _BLOCK_KEYS[lab]:
                        out[int(e.expert), _KI[k]] += 1
                out[2, 0] += 1
            else:
                out[int(e.expert), e.key] += 1
            out[3, e.key] += 1
        return out

    def _grad(self, e: _Entry) -> torch.Tensor:
        return e.param.main_grad

    def _add_fused(self, out: torch.Tensor, e: _Entry, grad: torch.Tensor, owned: bool) -> None:
        row = int(e.expert)
        if owned and self.dist_opt:
            lo, hi = e.owned
            if hi <= lo:
                return
            r0, sq = _owned_row_sq(grad.view(-1), lo, hi, e.cols)
            labels = e.labels[r0:r0 + sq.numel()]
        else:
            sq = _row_sq(grad.view(e.rows, -1))
            labels = e.labels
        blocks = torch.zeros(3, dtype=torch.float64, device=sq.device).index_add_(0, labels, sq)
        for lab in range(3):
            for k in _BLOCK_KEYS[lab]:
                out[row, _KI[k]] += blocks[lab]

    def local(self, mode: str) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``mode="pre"``: the full local gradient (before the DP reduction; SP-partial entries are returned as
        one flat copy for the TP all-reduce instead of being counted); ``mode="post"``: the reduced gradient
        (the owned shard with the distributed optimizer). Returns ([2, NK] float64 contributions, flat SP copy)."""
        out = torch.zeros(2, _NK, dtype=torch.float64, device=self.device)
        views, rows, keys = [], [], []
        for e in self.entries:
            if mode == "pre" and e.tp_reduce is not None:
                continue
            if not e.counted:
                continue
            grad = self._grad(e)
            if e.fused:
                self._add_fused(out, e, grad, owned=(mode == "post"))
                continue
            if mode == "post" and self.dist_opt:
                lo, hi = e.owned
                if hi <= lo:
                    continue
                views.append(grad.view(-1)[lo:hi])
            else:
                views.append(grad.view(-1))
            rows.append(int(e.expert))
            keys.append(e.key)
        if views:
            norms = torch.stack(torch._foreach_norm(views)).double() ** 2
            idx = torch.tensor(rows, device=self.device) * _NK + torch.tensor(keys, device=self.device)
            out.view(-1).index_add_(0, idx, norms)
        sp = None
        if mode == "pre" and self.sp_entries:
            sp = torch.cat([self._grad(e).detach().reshape(-1).double() for e in self.sp_entries])
        return out, sp

    def sp_contrib(self, summed: torch.Tensor) -> torch.Tensor:
        """Contributions of the TP-summed SP-partial entries (counted on TP rank 0)."""
        out = torch.zeros(2, _NK, dtype=torch.float64, device=self.device)
        off = 0
        for e in self.sp_entries:
            n = e.param.numel()
            seg = summed[off:off + n]
            off += n
            if not e.counted:
                continue
            if e.tp_reduce == "avg":
                seg = seg / self.tp_size
            out[int(e.expert), e.key] += seg.pow(2).sum()
        return out

    def vectors(self) -> Dict[str, torch.Tensor]:
        """Per key: this rank's counted coordinates of the (fully reduced) gradient as one flat float64 copy
        (the sample estimator; fused QKV blocks split with taxonomy.fused_qkv_blocks row labels)."""
        parts: Dict[str, List[torch.Tensor]] = {}
        for e in self.entries:
            if not e.counted:
                continue
            grad = self._grad(e).detach().double()
            if e.fused:
                g2 = grad.view(e.rows, -1)
                for lab in range(3):
                    block = g2[e.labels == lab].reshape(-1)
                    for k in _BLOCK_KEYS[lab]:
                        parts.setdefault(k, []).append(block)
            else:
                parts.setdefault(_KEYS[e.key], []).append(grad.reshape(-1))
        return {k: torch.cat(v) for k, v in parts.items()}


# ------------------------------------------------------------------------------------------------ arguments
def add_mols_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``--mech-mols*`` flags alone (generated from :class:`megatron_mech.config.MoLSOptions`; usable
    inside Megatron-LM's ``extra_args_provider``)."""
    from megatron_mech.config import MoLSOptions
    from megatron_mech.options import add_section_flags

    add_section_flags(parser.add_argument_group("megatron-mech MoLS (module-wise lr scaling from gradient SNR)"),
                      MoLSOptions)
    return parser


# ------------------------------------------------------------------------------------------------ the object
class _DisabledMoLS:
    """What :meth:`MegatronMoLS.from_args` returns without ``--mech-mols``: every method is a no-op."""

    enabled = False
    config_overrides = None

    def install(self, *a, **k):
        return self

    def wrap_forward_step(self, fn):
        return fn

    def sample_step(self, *a, **k):
        return False

    def before_scheduler_step(self, *a, **k):
        return None

    def apply(self, *a, **k):
        return None

    def metrics(self, *a, **k):
        return {}

    def table(self, *a, **k):
        return ""

    seconds = 0.0

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        return None


class MegatronMoLS:
    """MoLS for a megatron-core model: see the module docstring for the call order.

    Args:
        config: :class:`megatron_mech.core.mols.MoLSConfig` (``window_steps`` set).
        model_chunks: the DDP-wrapped model chunks (``[model]``).
        optimizer_config: the ``OptimizerConfig`` passed to ``get_megatron_optimizer``.
        global_batch_size, micro_batch_size: in sequences (``B_big`` and the micro-batch route's ``B_small``).
        taxonomy: a :class:`~megatron_mech.core.taxonomy.ModuleTaxonomy` of these chunks (default: built here).
        route: ``"auto"`` | ``"dp"`` | ``"microbatch"`` — small-batch source of the two-batch estimator.
        log: callable for the table printed when the estimate completes (default: ``print`` on global rank 0).

    Construction is collective (one world all-reduce of per-class counts): call it on every rank.
    """

    enabled = True

    def __init__(self, config: MoLSConfig, model_chunks: Sequence[torch.nn.Module], optimizer_config,
                 *, global_batch_size: int, micro_batch_size: int, taxonomy: Optional[ModuleTaxonomy] = None,
                 route: str = "auto", log: Optional[Callable[[str], None]] = None):
        from megatron.core import parallel_state as ps
        from megatron.core.utils import get_model_config

        if route not in ROUTES:
            raise ValueError(f"route must be one of {ROUTES}, got {route!r}")
        self.model_chunks = list(model_chunks)
        self.optimizer_config = optimizer_config
        self.model_config = get_model_config(self.model_chunks[0])
        self.taxonomy = taxonomy if taxonomy is not None else build_taxonomy(self.model_chunks)
        self.global_batch_size, self.micro_batch_size = int(global_batch_size), int(micro_batch_size)
        self.dp = ps.get_data_parallel_world_size()
        self.edp = ps.get_expert_data_parallel_world_size()
        self.pp = ps.get_pipeline_model_parallel_world_size()
        self.cp = ps.get_context_parallel_world_size()
        if self.global_batch_size % (self.micro_batch_size * self.dp):
            raise ValueError(f"global batch {global_batch_size} is not divisible by micro-batch × DP = "
                             f"{micro_batch_size} × {self.dp}")
        self.num_microbatches = self.global_batch_size // (self.micro_batch_size * self.dp)
        self._reader = _GradNormReader(self.model_chunks, self.taxonomy, self.model_config)
        presence = self._reader.presence().to(self._reader.device)
        torch.distributed.all_reduce(presence)
        presence = presence.cpu()
        self.dense_keys = {k for k in _KEYS if presence[0, _KI[k]] > 0}
        self.expert_keys = {k for k in _KEYS if presence[1, _KI[k]] > 0}
        mixed = sorted(self.dense_keys & self.expert_keys)
        if mixed:
            raise ValueError(f"module key(s) {mixed} hold both expert-parallel and dense parameters; their small "
                             "batches differ, so MoLS cannot estimate them (map them with taxonomy extra_rules)")
        self.keys = [k for k in _KEYS if k in self.dense_keys | self.expert_keys]
        classes_present = [c for c in MODULE_CLASSES if presence[3, _KI[c]] > 0]
        fused = None
        if presence[2, 0] > 0:
            cfg = self.model_config
            fused = (cfg.num_attention_heads, cfg.num_query_groups or cfg.num_attention_heads)
        if config.window_steps is None:
            raise ValueError("MoLSConfig.window_steps must be set (MegatronMoLS.from_args uses 1% of train iters)")
        self.controller = MoLSController(config, classes_present=classes_present, fused_qkv=fused)
        self.config = config
        self.group_classes = tuple(classes_present)
        self.route = None
        if config.estimator == "two_batch":
            self.route = self._choose_route(route)
        self._log = log if log is not None else logger.info
        self._suspended = 0  # > 0 while the reference estimator's sample passes run: the wrappers pass through
        self._iteration = 0  # the iteration in progress / next to run; install(iteration=...), load_state_dict
        self._fwd_count = 0
        self._snap = None
        self._observed_iteration = None
        self._finalize_wrapper = None
        self.optimizer = None
        self.last_observation: Optional[dict] = None
        self._config_overrides = None
        self.seconds = 0.0  # wall time spent measuring and applying (overhead accounting, benchmarks)

    # -- construction helpers
    @classmethod
    def from_args(cls, args, model_chunks, optimizer_config, taxonomy=None, log=None):
        """Build from parsed arguments (``--mech-mols*`` plus Megatron's ``--train-iters``/``--train-samples``,
        ``--lr-warmup-iters``/``-samples``/``-fraction``, ``--global-batch-size``, ``--micro-batch-size``).
        Returns a no-op object when ``--mech-mols`` is not given."""
        from megatron_mech.config import MoLSOptions
        from megatron_mech.megatron.flags import lr_warmup_steps, train_steps
        from megatron_mech.options import section_from_flags

        options = section_from_flags(MoLSOptions, args)
        if not options.enabled:
            return _DisabledMoLS()
        steps = train_steps(args)
        if not steps:
            raise ValueError("--mech-mols needs --train-iters (or --train-samples) to size the estimation window")
        config = options.core_config(window=options.window if options.window is not None else default_window(steps),
                                     ramp_end=lr_warmup_steps(args))
        if config.window_end > steps:
            raise ValueError(f"--mech-mols-window: the estimation window (iterations {config.window_start}.."
                             f"{config.window_end - 1}) does not fit in --train-iters {steps}")
        return cls(config, model_chunks, optimizer_config, global_batch_size=int(args.global_batch_size),
                   micro_batch_size=int(args.micro_batch_size), taxonomy=taxonomy, log=log)

    def _choose_route(self, route: str) -> str:
        cfg = self.model_config
        hint = " (or use --mech-mols-estimator samples)"
        if getattr(cfg, "calculate_per_token_loss", False):
            raise ValueError("MoLS two_batch estimator: calculate_per_token_loss normalises gradients by the global "
                             "token count only after the DP reduction, so the local gradient's batch is unknown"
                             + hint)
        if self.cp > 1:
            raise ValueError("MoLS two_batch estimator: context parallelism splits sequences, not examples, across "
                             "the data-parallel group" + hint)
        if self.pp > 1 and any(getattr(p, "shared_embedding", False) for c in self.model_chunks
                               for p in c.parameters()):
            raise ValueError("MoLS two_batch estimator: tied embeddings under pipeline parallelism are reduced "
                             "across stages only in finalize; not supported" + hint)
        overlap = bool(getattr(self.model_chunks[0].ddp_config, "overlap_grad_reduce", False))
        need_dp = [self.dp] + ([self.edp] if self.expert_keys else [])
        can_dp = min(need_dp) > 1 and not overlap
        can_micro = self.num_microbatches >= 2 and self.pp == 1
        if route == "auto":
            route = "dp" if can_dp else "microbatch" if can_micro else None
        if route == "dp" and not can_dp:
            raise ValueError(f"MoLS route 'dp' needs DP > 1 (and expert-DP > 1 with MoE experts) and "
                             f"overlap_grad_reduce=False; here DP={self.dp}, expert-DP={self.edp}, overlap={overlap}")
        if route == "microbatch" and not can_micro:
            raise ValueError(f"MoLS route 'microbatch' needs >= 2 micro-batches per step and no pipeline "
                             f"parallelism; here {self.num_microbatches} micro-batch(es), PP={self.pp}")
        if route is None:
            why = (f"overlap_grad_reduce=True hides the local gradient at finalize, and with "
                   f"{self.num_microbatches} micro-batch(es) per step there is no micro-batch snapshot" if overlap
                   else f"DP={self.dp}{f', expert-DP={self.edp}' if self.expert_keys else ''} gives no small/big "
                        f"batch pair and {self.num_microbatches} micro-batch(es) per step (PP={self.pp}) give none "
                        f"either")
            raise ValueError("MoLS two_batch estimator needs a small and a big batch: " + why
                             + "; use DP > 1 or gradient accumulation (>= 2 micro-batches)" + hint)
        return route

    @property
    def config_overrides(self) -> Dict:
        """Pass as ``get_megatron_optimizer(..., config_overrides=mols.config_overrides)``."""
        if self._config_overrides is None:
            self._config_overrides = mols_config_overrides(self.model_chunks, self.optimizer_config, self.taxonomy)
        return self._config_overrides

    @contextlib.contextmanager
    def _suspend(self):
        """The reference estimator's sample passes run through the same schedule: every MoLS wrapper of this
        object passes through meanwhile."""
        self._suspended += 1
        try:
            yield
        finally:
            self._suspended -= 1

    # -- installation
    def attach(self, optimizer) -> "MegatronMoLS":
        """:meth:`install` into the model's own config (the one ``forward_backward_func`` reads)."""
        return self.install(self.model_config, optimizer)

    def install(self, model_config, optimizer, iteration: Optional[int] = None) -> "MegatronMoLS":
        """Attach to the optimizer and the model config: protect the param-group identity for checkpoint loads,
        wrap ``model_config.finalize_model_grads_func`` (two_batch; megatron's ``finalize_model_grads`` if unset)
        and write the multipliers of ``iteration`` (default: the controller's next iteration, 0 for a fresh run).
        Call after ``get_megatron_optimizer`` and after setting ``finalize_model_grads_func``, before loading
        optimizer state and before building the scheduler."""
        untagged = [g for g in _param_groups(optimizer) if g.get("params") and TAG not in g]
        if untagged:
            raise ValueError(f"{len(untagged)} optimizer param group(s) carry no {TAG!r} tag: build the optimizer "
                             "with get_megatron_optimizer(..., config_overrides=mols.config_overrides)")
        self.optimizer = optimizer
        protect_param_group_identity(optimizer)
        scaled = set(self.controller.scaled_classes(self.group_classes))
        for g in _param_groups(optimizer):
            _record_bases(g)
            if "default_config" in g and g.get(TAG) in scaled and g.get(TAG) != self.config.base:
                g["default_config"] = False  # Megatron-LM logs the lr of the first default_config group
        if self.config.estimator == "two_batch" and self._finalize_wrapper is None:
            real = model_config.finalize_model_grads_func
            if real is None:
                from megatron.core.distributed import finalize_model_grads as real
            self._finalize_wrapper = self._make_finalize(real)
            model_config.finalize_model_grads_func = self._finalize_wrapper
        self.model_config = model_config
        if iteration is not None:
            self._iteration = int(iteration)
        self.apply(self._iteration)
        return self

    def apply(self, iteration: int) -> None:
        """Write the multipliers of ``iteration`` into the param groups (effective at the scheduler's next step)."""
        if self.optimizer is None:
            return
        c = self.controller
        mults = {cls: c.multiplier(iteration, cls) for cls in self.group_classes}
        wd = None if self.config.scale_weight_decay else {
            cls: c.wd_multiplier(iteration, cls) for cls in self.group_classes}
        apply_multipliers(self.optimizer, mults, wd_multipliers=wd)

    # -- statistics
    def wrap_forward_step(self, forward_step_func: Callable) -> Callable:
        """Count forward calls per step and, on the micro-batch route during the window, snapshot the local
        per-key squared norms when the 2nd forward of a step starts. Evaluation forwards (under ``no_grad`` or
        with the model in eval mode) are ignored. Returns the function unchanged when no snapshot is needed."""
        if self.config.estimator != "two_batch" or self.route != "microbatch":
            return forward_step_func

        @functools.wraps(forward_step_func)
        def forward_step(*args, **kwargs):
            model = args[1] if len(args) > 1 else kwargs.get("model")
            if self._suspended or not torch.is_grad_enabled() or not getattr(model, "training", True):
                return forward_step_func(*args, **kwargs)
            self._fwd_count += 1
            if self._fwd_count == 2 and self.controller.in_window(self._iteration):
                started = time.perf_counter()
                self._snap = self._reader.local("pre")
                self.seconds += time.perf_counter() - started
            return forward_step_func(*args, **kwargs)

        forward_step._mols_wrapped = True
        return forward_step

    def _make_finalize(self, real: Callable) -> Callable:
        @functools.wraps(real)
        def finalize_model_grads(*args, **kwargs):
            if self._suspended:
                return real(*args, **kwargs)
            it = self._iteration
            active = self.controller.in_window(it)
            started = time.perf_counter()
            pre = self._reader.local("pre") if active and self.route == "dp" else None
            self.seconds += time.perf_counter() - started
            out = real(*args, **kwargs)
            if active:
                started = time.perf_counter()
                self._observe(it, pre)
                self.seconds += time.perf_counter() - started
            self._fwd_count, self._snap = 0, None
            return out

        finalize_model_grads._mols_real = real
        return finalize_model_grads

    def _observe(self, it: int, pre) -> None:
        r = self._reader
        if self.route == "microbatch":
            small, ok, num_micro = self._snap, 1.0, self._fwd_count
            if small is None:  # no snapshot on this rank: join the collectives with zeros, skip the step below
                ok = 0.0
                small = (torch.zeros(2, _NK, dtype=torch.float64, device=r.device),
                         torch.zeros(sum(e.param.numel() for e in r.sp_entries), dtype=torch.float64,
                                     device=r.device) if r.sp_entries else None)
        else:
            small, ok, num_micro = pre, 1.0, self.num_microbatches
        post, _ = r.local("post")
        small_c, small_sp = small
        if small_sp is not None:  # SP-partial gradients: sum the copies over TP (same count on every TP rank)
            small_sp = small_sp.clone()
            torch.distributed.all_reduce(small_sp, group=r.tp_group)
            small_c = small_c + r.sp_contrib(small_sp)
        vec = torch.cat([small_c.reshape(-1), post.reshape(-1), torch.tensor([ok, float(max(num_micro, 0))],
                                                                              dtype=torch.float64,
                                                                              device=r.device)])
        torch.distributed.all_reduce(vec)
        vec = vec.cpu()
        world = torch.distributed.get_world_size()
        if vec[-2].item() < world:  # some rank took no snapshot (e.g. 1 micro-batch this step): skip the step
            self._observed_iteration = it
            return
        num_micro = int(round(vec[-1].item() / world))
        if self.route == "microbatch" and num_micro < 2:
            self._observed_iteration = it
            return
        small_c = vec[:2 * _NK].view(2, _NK)
        post = vec[2 * _NK:4 * _NK].view(2, _NK)
        ls = 1.0
        if self.optimizer is not None and hasattr(self.optimizer, "get_loss_scale"):
            ls = float(self.optimizer.get_loss_scale())
        ls2 = ls * ls
        B = self.micro_batch_size * num_micro * self.dp
        small_n, big_n, small_b = {}, {}, {}
        for k in self.keys:
            expert = k in self.expert_keys
            row, rdp = (1, self.edp) if expert else (0, self.dp)
            post_div = rdp / r.shards[expert] if r.dist_opt else rdp
            factor = (self.edp / self.dp) ** 2 if expert else 1.0
            if self.route == "microbatch":
                factor *= num_micro ** 2
                small_b[k] = self.micro_batch_size * self.dp / rdp
            else:
                small_b[k] = B / rdp
            small_n[k] = small_c[row, _KI[k]].item() / rdp * factor / ls2
            big_n[k] = post[row, _KI[k]].item() / post_div / ls2
        self.last_observation = {"iteration": it, "small": small_n, "big": big_n, "small_batch": small_b,
                                 "big_batch": B, "route": self.route}
        was_done = self.controller.done
        self.controller.observe(it, small_n, big_n, small_b, B)
        self._observed_iteration = it
        if self.controller.done and not was_done:
            self._announce()

    def _announce(self) -> None:
        self._log(self.controller.table(self.controller.window_end))

    # -- the reference estimator
    def sample_step(self, iteration: int, forward_backward_func: Callable, forward_step_func: Callable,
                    data_iterator, *, seq_length: int, micro_batch_size: Optional[int] = None,
                    **forward_backward_kwargs) -> bool:
        """``--mech-mols-estimator samples``: at a window iteration, run K extra forward/backward passes (one
        micro-batch each, drawn from ``data_iterator``, all-reduced over DP) and feed
        :func:`megatron_mech.core.snr.sample_snr`. No-op (False) otherwise. Call before ``zero_grad_buffer()`` of the
        training step: it leaves the grad buffers holding the last sample. It clears ``param.grad`` before each
        pass (megatron's FP32Optimizer leaves it aliased to ``main_grad`` after ``step()``)."""
        if self.config.estimator != "samples" or not self.controller.in_window(iteration):
            return False
        mbs = int(micro_batch_size or self.micro_batch_size)
        r = self._reader
        samples: Dict[str, List[torch.Tensor]] = {}
        ls = float(self.optimizer.get_loss_scale()) if self.optimizer is not None and hasattr(
            self.optimizer, "get_loss_scale") else 1.0
        with self._suspend():
            for _ in range(self.config.num_samples):
                for chunk in self.model_chunks:
                    chunk.zero_grad_buffer()
                    # megatron's FP32Optimizer leaves param.grad aliased to param.main_grad after step(); a
                    # backward before the training step's optimizer.zero_grad() would then count the gradient twice
                    for param in chunk.parameters():
                        param.grad = None
                forward_backward_func(forward_step_func=forward_step_func, data_iterator=data_iterator,
                                      model=self.model_chunks, num_microbatches=1, seq_length=seq_length,
                                      micro_batch_size=mbs, forward_only=False, force_all_reduce=True,
                                      **forward_backward_kwargs)
                for k, v in r.vectors().items():
                    samples.setdefault(k, []).append(v / ls)
        comp = torch.zeros(2, _NK, 2, dtype=torch.float64)
        for k, vs in samples.items():
            if vs[0].numel() == 0:
                continue
            est = sample_snr(torch.stack(vs), batch_size=mbs * self.dp)
            row = 1 if k in self.expert_keys else 0
            comp[row, _KI[k], 0] += est.grad_sq
            comp[row, _KI[k], 1] += est.trace_cov
        comp = comp.to(r.device)
        torch.distributed.all_reduce(comp)
        comp = comp.cpu()
        out = {}
        for k in self.keys:
            row, rdp = (1, self.edp) if k in self.expert_keys else (0, self.dp)
            out[k] = (comp[row, _KI[k], 0].item() / rdp, comp[row, _KI[k], 1].item() / rdp)
        self.last_observation = {"iteration": int(iteration), "components": out, "batch": mbs * self.dp}
        was_done = self.controller.done
        self.controller.observe_estimates(iteration, out)
        if self.controller.done and not was_done:
            self._announce()
        return True

    # -- per step
    def before_scheduler_step(self, iteration: Optional[int] = None) -> None:
        """After ``optimizer.step()`` of ``iteration`` and before ``scheduler.step()``: complete the estimate at the
        window end and write the multipliers of ``iteration + 1``."""
        it = self._iteration if iteration is None else int(iteration)
        if (self.config.estimator == "two_batch" and self.controller.in_window(it)
                and self._observed_iteration != it):
            raise RuntimeError(f"MoLS: no gradient statistics were taken for iteration {it}: the finalize wrapper "
                               "did not run (was config.finalize_model_grads_func replaced after mols.install()? "
                               f"is iteration={it} the iteration that just ran?)")
        started = time.perf_counter()
        if self.controller.maybe_finalize(it):
            self._announce()
        self._iteration = it + 1
        self.apply(self._iteration)
        self.seconds += time.perf_counter() - started

    # -- reporting and state
    @property
    def iteration(self) -> int:
        """The iteration whose multipliers are currently written (the next one to run)."""
        return self._iteration

    def metrics(self, iteration: Optional[int] = None) -> Dict[str, float]:
        """``controller.metrics`` at ``iteration`` (default: the next iteration, whose multipliers are live)."""
        return self.controller.metrics(self._iteration if iteration is None else iteration)

    def table(self, iteration: Optional[int] = None) -> str:
        return self.controller.table(self._iteration if iteration is None else iteration)

    def state_dict(self) -> Dict[str, Any]:
        """Plain types; identical on every rank (all estimates are all-reduced)."""
        return {"version": 1, "controller": self.controller.state_dict(), "iteration": self._iteration,
                "route": self.route}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore and, when installed, write the multipliers of the restored next iteration into the groups
        (so a scheduler loaded afterwards — or ``scheduler.step(0)`` — sets the same lrs as the saved run)."""
        if not state:
            return
        if state.get("version") != 1:
            raise ValueError(f"unsupported MegatronMoLS state version {state.get('version')!r}")
        self.controller.load_state_dict(state["controller"])
        self._iteration = int(state["iteration"])
        self._fwd_count, self._snap = 0, None
        self.apply(self._iteration)
