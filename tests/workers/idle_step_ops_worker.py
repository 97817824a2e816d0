"""Train with the megatron-core entry point under a ``TorchDispatchMode`` that attributes every torch op (collectives
and host syncs included: ``c10d.*``, ``aten._local_scalar_dense``) to the code that issued it, for
tests/test_idle_steps.py.

Usage (under torchrun): ``idle_step_ops_worker.py OUT.json <pretrain_gpt flags>``. An op belongs to the monitoring
code when the innermost frame that is megatron-mech, megatron-core or this script (torch, the standard library and
the CPU shims' pass-through mode are looked through) is one of :data:`MONITOR_CODE`. Ops are counted per optimizer
step, from ``MechHook.before_step(step)`` to the end of ``MechHook.after_optimizer_step(step)`` (the forward
hooks the monitors install run in between); ops outside every step (set-up, final validation, saving) are not
counted. Rank 0 writes ``{step: {"<file>:<function>:<op>": count}}`` to ``OUT.json``, the file (relative to the
repository) and function being the innermost monitoring-code frame.
"""
from __future__ import annotations

import collections
import json
import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from megatron_mech import hook as hook_module  # noqa: E402
from megatron_mech.megatron.pretrain_gpt import main  # noqa: E402

MONITOR_CODE = tuple(os.path.join(REPO_ROOT, "megatron_mech", part) for part in (
    "hook.py", "logit_symptom.py", "model_view.py", "monitors" + os.sep, "core" + os.sep, "records" + os.sep,
    os.path.join("megatron", "discovery.py"), os.path.join("megatron", "mols") + os.sep))
PASS_THROUGH = os.path.join(REPO_ROOT, "megatron_mech", "megatron", "cpu_shims.py")
OTHER_CODE = (os.path.join(REPO_ROOT, "megatron_mech") + os.sep, os.sep + os.path.join("megatron", "core") + os.sep,
              os.path.abspath(__file__))

current_step = None
ops_per_step: dict = collections.defaultdict(collections.Counter)


def monitor_frame():
    """``"<file>:<function>"`` of the monitoring code that issued the op being dispatched, or None."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if name != PASS_THROUGH:
            if name.startswith(MONITOR_CODE):
                return f"{os.path.relpath(name, REPO_ROOT)}:{frame.f_code.co_name}"
            if name.startswith(OTHER_CODE[0]) or name == OTHER_CODE[2] or OTHER_CODE[1] in name:
                return None
        frame = frame.f_back
    return None


class MonitorOps(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        where = monitor_frame() if current_step is not None else None
        if where is not None:
            op = func.overloadpacket.__name__ if func.namespace == "aten" else f"{func.namespace}.{func.__name__}"
            ops_per_step[current_step][f"{where}:{op}"] += 1
        return func(*args, **(kwargs or {}))


original_before, original_after = hook_module.MechHook.before_step, hook_module.MechHook.after_optimizer_step


def before_step(self, step):
    global current_step
    current_step = int(step)
    ops_per_step[current_step]  # every step gets an entry, also one without ops
    return original_before(self, step)


def after_optimizer_step(self, step, **kwargs):
    global current_step
    try:
        return original_after(self, step, **kwargs)
    finally:
        current_step = None


hook_module.MechHook.before_step = before_step
hook_module.MechHook.after_optimizer_step = after_optimizer_step

if __name__ == "__main__":
    out_file = sys.argv[1]
    with MonitorOps():
        main(sys.argv[2:])
    if int(os.environ.get("RANK", "0")) == 0:
        with open(out_file, "w") as f:
            json.dump({str(step): dict(ops) for step, ops in sorted(ops_per_step.items())}, f)
