"""Train a megatron-core GPT (dense or MoE) with megatron-mech's monitors. Launch with torchrun:

    torchrun --nproc_per_node=2 launch_scripts/pretrain_gpt_mech.py --num-experts 4 \\
        --expert-model-parallel-size 2 --train-iters 300 --save runs/demo

See ``python launch_scripts/pretrain_gpt_mech.py --help`` for every flag; the code is
``megatron_mech/trainers/megatron_core/pretrain_gpt.py`` (installed with the package, so this file is only a
launcher). Fault injection is a study, not the product: its ``--mech-fault*`` flags are refused here, naming the
studies' launcher that takes them (``torchrun -m megatron_mech.studies.pretrain_gpt_fault``).
"""
import sys
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[1]
if (CHECKOUT / "megatron_mech" / "__init__.py").is_file():  # runnable from a checkout without installing
    sys.path.insert(0, str(CHECKOUT))  # (installed, this file sits inside megatron_mech/: nothing to add)

from megatron_mech.trainers.megatron_core.flags import build_parser  # noqa: E402
from megatron_mech.trainers.megatron_core.pretrain_gpt import main  # noqa: E402


def refuse_study_flags(argv) -> None:
    """Exit with a one-line error when ``argv`` holds a flag of the studies' launcher (``--mech-fault*``,
    ``--mech-record-routing``), before anything is built; any other unknown flag is left to the entry point's own
    error. The studies are imported only then, to read their flags."""
    _, unknown = build_parser().parse_known_args(argv)
    if not any(arg.startswith("--") for arg in unknown):
        return
    from megatron_mech.studies.pretrain_gpt_fault import study_flag_refusal

    refusal = study_flag_refusal(unknown, "the product's entry point")
    if refusal:
        print(f"pretrain_gpt_mech.py: error: {refusal}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    refuse_study_flags(sys.argv[1:])
    sys.exit(main())
