"""torchrun worker: the real training entry point, with the attention monitor's evaluation made to fail on one rank.

Usage: ``torchrun ... async_fault_worker.py MODE RANK STEP <pretrain_gpt flags>``. On global rank ``RANK`` (``-1``:
every rank), the attention monitor's evaluation of step ``STEP`` raises (``MODE=raise``) or never returns
(``MODE=hang``: it sleeps until the process ends); every other evaluation is the real one. The process exits with the entry point's code.
"""
import os
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron_mech.monitors.attention import monitor as attention_monitor  # noqa: E402
from megatron_mech.trainers.megatron_core.pretrain_gpt import main  # noqa: E402

mode, fault_rank, fault_step = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
original_evaluate = attention_monitor.AttentionMonitor.evaluate


def evaluate(self, step, snapshot):
    if fault_rank in (-1, int(os.environ.get("RANK", "0"))) and step == fault_step:
        if mode == "raise":
            raise RuntimeError(f"injected failure of the attention evaluation at step {step}")
        threading.Event().wait()   # hangs: only the daemon thread's end with the process stops it
    return original_evaluate(self, step, snapshot)


attention_monitor.AttentionMonitor.evaluate = evaluate

if __name__ == "__main__":
    sys.exit(main(sys.argv[4:]))
