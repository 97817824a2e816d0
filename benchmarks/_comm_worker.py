"""torchrun worker for bench_monitor_overhead.py: the real training entry point with every collective issued
inside the monitors (``MechHook.after_optimizer_step``) counted. Rank 0 writes ``COUNT_FILE`` (JSON):
{"evaluations": n, "collectives": [...per evaluation...], "bytes": [...]}.

Usage: torchrun ... benchmarks/_comm_worker.py COUNT_FILE <pretrain_gpt flags>
"""
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch.distributed as dist  # noqa: E402

from megatron_mech.hook import MechHook  # noqa: E402
from megatron_mech.trainers.megatron_core.pretrain_gpt import main  # noqa: E402

count_file = Path(sys.argv[1])
inside = {"on": False}
current = {"collectives": 0, "bytes": 0}
per_evaluation = []


def counting(name):
    real = getattr(dist, name)

    def wrapper(tensor, *args, **kwargs):
        if inside["on"]:
            tensors = tensor if isinstance(tensor, (list, tuple)) else [tensor]
            current["collectives"] += 1
            current["bytes"] += sum(t.numel() * t.element_size() for t in tensors if hasattr(t, "numel"))
        return real(tensor, *args, **kwargs)
    return wrapper


for name in ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast"):
    setattr(dist, name, counting(name))

original_after_step = MechHook.after_optimizer_step


def after_step(self, step, *args, **kwargs):
    inside["on"] = True
    current.update(collectives=0, bytes=0)
    try:
        return original_after_step(self, step, *args, **kwargs)
    finally:
        inside["on"] = False
        if current["collectives"]:
            per_evaluation.append(dict(current))


MechHook.after_optimizer_step = after_step
try:
    main(sys.argv[2:])
finally:
    if int(os.environ.get("RANK", "0")) == 0:
        count_file.write_text(json.dumps({"evaluations": len(per_evaluation), "per_evaluation": per_evaluation}))
