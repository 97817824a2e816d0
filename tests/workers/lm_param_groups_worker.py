"""Worker: checkpoint loads of MoLS param groups when megatron-core identifies groups by ``max_lr`` too (0.19+).

megatron-core 0.19 matches saved to current param groups by the override keys as well (``max_lr``, ``min_lr``,
``wd_mult``, ...). Only 0.16.1 runs here, so the job sets 0.16.1's own ``param_group_identifier_keys`` (the
module global its ``_filter_and_reorder_param_groups`` reads at load time) to such a tuple, then: train a MoLS
model two steps, scale its groups (multipliers ≠ 1, as after MoLS's window), save the optimizer state, build a
fresh model + optimizer (multipliers 1) and load. Reported: the load with MoLS's own protection only (0.16–0.18
rule) and with ``protect_for_this_version`` added, and what ``override_keys_identify_groups`` says under each
key tuple. The same job with the original keys checks that nothing is added there.
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import warnings
from functools import partial

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from fork_runner import fork_runner, import_megatron_core  # noqa: E402
from mols_worker import Trainer, _init_parallel, build, mols_config  # noqa: E402

KEYS_019 = ("max_lr", "min_lr", "wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr")


def _groups(optimizer):
    return [[g.get("mols_module"), float(g["wd_mult"]), len(g["params"])] for g in optimizer.param_groups]


def run_spec(spec: dict) -> dict:
    from megatron.core.optimizer import optimizer as moptimizer

    from megatron_mech.adapters.megatron_core import cpu_shims as mcpu
    from megatron_mech.adapters.megatron_core.mols import apply_multipliers
    from megatron_mech.adapters.megatron_lm_fork.param_group_loading import override_keys_identify_groups, protect_for_this_version

    mcpu.apply_cpu_shims()
    warnings.simplefilter("ignore")
    _init_parallel(spec)
    if spec["keys"] == "0.19":
        moptimizer.param_group_identifier_keys = KEYS_019
    out = {"identify": override_keys_identify_groups()}
    a = build(spec, mols_config(spec))
    Trainer(spec, a).run(0, 2)
    classes = sorted({g["mols_module"] for g in a["optimizer"].param_groups})
    apply_multipliers(a["optimizer"], {cls: 1.0 + 0.25 * (i % 3) for i, cls in enumerate(classes)})
    expected = _groups(a["optimizer"])
    saved = copy.deepcopy(a["optimizer"].state_dict())
    for extra in (False, True):
        b = build(spec, mols_config(spec))
        added = protect_for_this_version(b["optimizer"]) if extra else None
        try:
            b["optimizer"].load_state_dict(copy.deepcopy(saved))
            res = {"loaded": True, "match": _groups(b["optimizer"]) == expected}
        except Exception as e:  # noqa: BLE001
            res = {"loaded": False, "error": f"{type(e).__name__}: {e}"[:300]}
        res["added"] = added
        out["with_version_guard" if extra else "mols_protection_only"] = res
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", required=True, help="JSON file with a list of job specs")
    fork_runner(parser.parse_args().jobs, run_spec,
                import_once=partial(import_megatron_core, "megatron_mech.adapters.megatron_core.mols"),
                tmp_prefix="lm_groups_jobs_", json_default=float)
