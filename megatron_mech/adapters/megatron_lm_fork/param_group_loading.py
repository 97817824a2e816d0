"""Checkpoint loads of MoLS param groups, by megatron-core version.

megatron-core matches saved param groups to current ones by the keys in
``megatron.core.optimizer.optimizer.param_group_identifier_keys``:

* 0.16.1 – 0.18.x: ``('wd_mult', 'lr_mult', 'is_expert_parallel', 'is_decoupled_lr')``. MoLS groups differ in
  ``max_lr``/``min_lr`` and their tag only, so they collide. ``MegatronMoLS.install`` already wraps each leaf
  optimizer's ``load_state_dict`` (:func:`megatron_mech.adapters.megatron_core.mols.protect_param_group_identity`):
  during the load, ``lr_mult`` carries a unique static identity per group.
* 0.19.0 on: the override keys (``max_lr``, ``min_lr``, ``wd_mult``, ``start_wd``, ``end_wd``, ...) are
  identifiers too, so the groups no longer collide — but MoLS *changes* ``max_lr``/``min_lr`` during training,
  so the saved values (base × multiplier at save time) differ from the current ones (base × the multiplier
  installed before the load) and nothing would match. :func:`protect_for_this_version` adds a second wrapper
  there: during the load, ``max_lr``/``min_lr``/``wd_mult`` of every tagged group, saved and current, read as
  their static bases (``mols_base_*``). MoLS rewrites the live values afterwards from its restored state.

The version is read from the key tuple itself, not from a version string: a fork that back-ports the
0.19 change is handled as 0.19.
"""
from __future__ import annotations

from typing import List

from megatron_mech.adapters.megatron_core.mols.param_groups import TAG, _inner_groups, _saved_groups
from megatron_mech.optim import leaf_optimizers

__all__ = ["override_keys_identify_groups", "protect_for_this_version"]

_BASE_OF = {"max_lr": "mols_base_max", "min_lr": "mols_base_min", "wd_mult": "mols_base_wd_mult"}


def override_keys_identify_groups() -> bool:
    """True when this megatron-core matches param groups by ``max_lr`` (0.19.0 and later)."""
    from megatron.core.optimizer import optimizer as moptimizer

    return "max_lr" in tuple(getattr(moptimizer, "param_group_identifier_keys", ()))


def protect_for_this_version(optimizer) -> List[str]:
    """Add the 0.19+ wrapper when this megatron-core needs it (idempotent); returns the keys it pins during a
    load (``[]`` on 0.16–0.18, where ``MegatronMoLS.install``'s protection is all that is needed). Call after
    ``MegatronMoLS.install`` and before loading optimizer state."""
    if not override_keys_identify_groups():
        return []
    keys = list(_BASE_OF)
    for leaf in leaf_optimizers(optimizer):
        if getattr(leaf, "_mols_override_keys_pinned", False):
            continue
        original = leaf.load_state_dict

        def load_state_dict(state_dict, *args, _orig=original, _leaf=leaf, **kwargs):
            groups = [g for g in _inner_groups(_leaf) if TAG in g] + list(_saved_groups(state_dict))
            stash = [(g, {k: g.get(k) for k in keys}) for g in groups]
            for g in groups:
                for key, base in _BASE_OF.items():
                    if base in g:
                        g[key] = g[base]
            try:
                return _orig(state_dict, *args, **kwargs)
            finally:
                for g, values in stash:
                    g.update(values)

        leaf.load_state_dict = load_state_dict
        leaf._mols_override_keys_pinned = True
    return keys
