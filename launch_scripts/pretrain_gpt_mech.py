"""Train a megatron-core GPT (dense or MoE) with megatron-mech's monitors. Launch with torchrun:

    torchrun --nproc_per_node=2 launch_scripts/pretrain_gpt_mech.py --num-experts 4 \\
        --expert-model-parallel-size 2 --train-iters 300 --save runs/demo

See ``python launch_scripts/pretrain_gpt_mech.py --help`` for every flag; the code is
``megatron_mech/adapters/megatron_core/pretrain_gpt.py`` (installed with the package, so this file is only a launcher).
This launcher also offers the studies' ``--mech-fault*`` flags (``megatron_mech/studies/pretrain_gpt_fault.py``).
"""
import sys
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[1]
if (CHECKOUT / "megatron_mech" / "__init__.py").is_file():  # runnable from a checkout without installing
    sys.path.insert(0, str(CHECKOUT))  # (installed, this file sits inside megatron_mech/: nothing to add)

from megatron_mech.studies.pretrain_gpt_fault import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
