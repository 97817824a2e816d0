"""Run a patched Megatron-LM fork's ``pretrain_gpt.py`` with the studies' ``--mech-fault*`` flags (torchrun)::

    torchrun --nproc_per_node=2 launch_scripts/megatron_lm_fault.py <fork>/pretrain_gpt.py <its flags> \\
        --spec megatron_mech.adapters.megatron_lm_fork.fault_spec layer_spec \\
        --mech-fault attention --mech-fault-start 100

The code is ``megatron_mech/studies/megatron_lm_fault.py``; this file is only a launcher.
"""
import sys
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[1]
if (CHECKOUT / "megatron_mech" / "__init__.py").is_file():  # runnable from a checkout without installing
    sys.path.insert(0, str(CHECKOUT))

from megatron_mech.studies.megatron_lm_fault import main  # noqa: E402

if __name__ == "__main__":
    main()
