"""MoLS in megatron-core's optimizer: per-class param groups, multipliers written into them, and the param-group
identity that survives checkpoint loads.

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
"""
from __future__ import annotations

import math
from typing import Dict, List, Mapping, Optional, Tuple

import torch

from megatron_mech.adapters.megatron_core.mols.versions import megatron_core_version, multiplier_mode
from megatron_mech.core.taxonomy import MODULE_CLASSES, ModuleTaxonomy, classify_parameters
from megatron_mech.optim import inner_optimizer, leaf_optimizers, param_groups

__all__ = ["TAG", "apply_multipliers", "build_taxonomy", "class_by_id", "mols_config_overrides",
           "protect_param_group_identity", "record_bases"]

TAG = "mols_module"
"""The param-group key that names a group's module class (``{"mols_module": "qk"}``)."""


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


def class_by_id(taxonomy: ModuleTaxonomy) -> Dict[int, Tuple[str, str]]:
    """id(tensor) → (taxonomy name, class)."""
    if not taxonomy.parameters:
        raise ValueError("the taxonomy has no parameter tensors; build it with classify_parameters(...) on the "
                         "model (or pass taxonomy=None)")
    return {id(t): (n, taxonomy.classes[n]) for n, t in taxonomy.parameters.items()}


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
    by_id = class_by_id(taxonomy)
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


def record_bases(group: dict) -> None:
    """Remember a group's own lr/wd settings once, so multipliers are always applied to them (never compound)."""
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
    for group in param_groups(optimizer):
        cls = group.get(TAG)
        if cls is None:
            continue
        record_bases(group)
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
    inner = inner_optimizer(leaf)
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
