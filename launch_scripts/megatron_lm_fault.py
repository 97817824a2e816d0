"""Deprecated (removed in 0.3.0): the fault studies' Megatron-LM launcher runs as a module of the studies::

    torchrun --nproc_per_node=2 -m megatron_mech.studies.megatron_lm_fault <fork>/pretrain_gpt.py <its flags> \\
        --spec megatron_mech.adapters.megatron_lm_fork.fault_spec layer_spec \\
        --mech-fault attention --mech-fault-start 100

This script still runs it, with a ``DeprecationWarning``.
"""
import sys
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[1]
if (CHECKOUT / "megatron_mech" / "__init__.py").is_file():  # runnable from a checkout without installing
    sys.path.insert(0, str(CHECKOUT))

from megatron_mech._moved_modules import warn_moved_launcher  # noqa: E402
from megatron_mech.studies.megatron_lm_fault import main  # noqa: E402

if __name__ == "__main__":
    warn_moved_launcher("launch_scripts/megatron_lm_fault.py")
    main()
