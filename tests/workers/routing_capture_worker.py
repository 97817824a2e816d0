"""torchrun worker: the real training entry point, with every router-logit batch the monitor records saved.

Usage: ``torchrun ... routing_capture_worker.py CAPTURE_DIR <pretrain_gpt flags>``. Each rank writes
``CAPTURE_DIR/rank{r}.pt`` = {step: {layer: [logits, ...]}} with exactly the tensors ``RouterEvaluator.record``
accumulated for each evaluation, so a test can recompute the statistics of all tokens in one process and
compare them with what the run reduced over ranks and wrote to mech.jsonl.
"""
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from megatron_mech.monitors import router as router_monitor  # noqa: E402
from megatron_mech.trainers.megatron_core.pretrain_gpt import main  # noqa: E402

capture_dir = Path(sys.argv[1])
pending = defaultdict(list)   # layer -> logits recorded since the last evaluation
captured = {}                 # step -> {layer: [logits]}

original_record = router_monitor.RouterEvaluator.record
original_snapshot = router_monitor.RouterEvaluator.snapshot


def record(self, layer, logits):
    if self.capturing:
        pending[layer].append(logits.detach().clone())
    return original_record(self, layer, logits)


def snapshot(self, step):   # where an evaluation takes what was recorded since the last one
    captured[step] = dict(pending)
    pending.clear()
    return original_snapshot(self, step)


router_monitor.RouterEvaluator.record = record
router_monitor.RouterEvaluator.snapshot = snapshot

rank = None
try:
    main(sys.argv[2:])
finally:
    import os

    rank = int(os.environ.get("RANK", "0"))
    capture_dir.mkdir(parents=True, exist_ok=True)
    torch.save(captured, capture_dir / f"rank{rank}.pt")
