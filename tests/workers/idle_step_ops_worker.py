"""Train with the megatron-core entry point under :class:`op_attribution.OpsPerStep`, which attributes every torch
op (collectives and host syncs included: ``c10d.*``, ``aten._local_scalar_dense``) to the code that issued it, for
tests/integration/megatron_core/test_idle_steps.py.

Usage (under torchrun): ``idle_step_ops_worker.py OUT.json <pretrain_gpt flags>``. An op belongs to the monitoring
code when the innermost frame that is megatron-mech, megatron-core or this script (torch, the standard library and
the CPU shims' pass-through mode are looked through) is one of :data:`MONITOR_CODE`. Ops are counted per optimizer
step, from ``MechHook.before_step(step)`` to the end of ``MechHook.after_optimizer_step(step)`` (the forward
hooks the monitors install run in between); ops outside every step (set-up, final validation, saving) are not
counted. Rank 0 writes ``{step: {"<file>:<function>:<op>": count}}`` to ``OUT.json``, the file (relative to the
repository) and function being the innermost monitoring-code frame.
"""
from __future__ import annotations

import json
import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from op_attribution import OpsPerStep  # noqa: E402  (tests/workers/, the script's directory)

from megatron_mech import hook as hook_module  # noqa: E402
from megatron_mech.trainers.megatron_core.pretrain_gpt import main  # noqa: E402

MONITOR_CODE = tuple(os.path.join(REPO_ROOT, "megatron_mech", part) for part in (
    "hook" + os.sep, "extension.py", "model_view.py",
    "monitors" + os.sep, "core" + os.sep, "records" + os.sep,
    os.path.join("adapters", "megatron_core", "discovery.py"), os.path.join("adapters", "megatron_core", "mols") + os.sep))
PASS_THROUGH = os.path.join(REPO_ROOT, "megatron_mech", "adapters", "megatron_core", "cpu_shims.py")

ops = OpsPerStep(MONITOR_CODE, other=(os.path.join(REPO_ROOT, "megatron_mech") + os.sep, os.path.abspath(__file__)),
                 contains=(os.sep + os.path.join("megatron", "core") + os.sep,), pass_through=(PASS_THROUGH,))
original_before, original_after = hook_module.MechHook.before_step, hook_module.MechHook.after_optimizer_step


def before_step(self, step):
    ops.open(step)
    return original_before(self, step)


def after_optimizer_step(self, step, **kwargs):
    try:
        return original_after(self, step, **kwargs)
    finally:
        ops.close()


hook_module.MechHook.before_step = before_step
hook_module.MechHook.after_optimizer_step = after_optimizer_step

if __name__ == "__main__":
    out_file = sys.argv[1]
    with ops:
        main(sys.argv[2:])
    if int(os.environ.get("RANK", "0")) == 0:
        with open(out_file, "w") as f:
            json.dump(ops.as_json(), f)
