"""The megatron-core entry point with the studies' ``--mech-fault*`` flags (torchrun, like the product's)::

    torchrun --nproc_per_node=2 -m megatron_mech.studies.pretrain_gpt_fault --num-experts 4 \\
        --expert-model-parallel-size 2 --train-iters 300 --mech-fault attention --mech-fault-start 100

:func:`megatron_mech.trainers.megatron_core.pretrain_gpt.main` with the fault injector offered as a hook extension: the
flags are added to its parser, and a ``--mech-fault`` other than ``none`` registers a
:class:`~megatron_mech.studies.injectors.FaultInjector` on the run's hook (the model's attention, the global
batch, the lr of each step from the start step on, the routers' updates); ``--mech-record-routing DIR`` registers a
:class:`~megatron_mech.studies.router_outcome.RoutingRecorder`.
"""
import argparse
import sys
from typing import List, Optional, Set

from megatron_mech.studies.injectors import FaultInjector
from megatron_mech.studies.router_outcome import RoutingRecorder
from megatron_mech.trainers.megatron_core.launch import check_training_flags
from megatron_mech.trainers.megatron_core.pretrain_gpt import main as train

__all__ = ["ENTRY_MODULE", "EXTENSION_TYPES", "check_flags", "main", "study_flag_refusal", "study_flags"]

ENTRY_MODULE = "megatron_mech.studies.pretrain_gpt_fault"
"""What ``python -m`` runs for this entry point."""
EXTENSION_TYPES = (FaultInjector, RoutingRecorder)
"""The hook extensions this entry point offers: the fault, and the routing record (router faults' ground truth)."""


def check_flags(cmd: List[str], nproc: int) -> Optional[str]:
    """This entry point's start-up flag check on the flags of a torchrun command line that runs it (after
    :data:`ENTRY_MODULE`), before anything is launched: the error message, or ``None`` if they pass."""
    return check_training_flags(cmd, nproc, ENTRY_MODULE, EXTENSION_TYPES)


def study_flags() -> Set[str]:
    """Every flag this entry point adds to the product's (its extensions' ``--mech-fault*`` and
    ``--mech-record-routing``): the product's launcher refuses them by these names."""
    parser = argparse.ArgumentParser(add_help=False)
    for kind in EXTENSION_TYPES:
        kind.add_arguments(parser)
    return {flag for action in parser._actions for flag in action.option_strings}


def study_flag_refusal(flags, refused_by: str) -> Optional[str]:
    """One line refusing the first flag of ``flags`` (a command line's arguments) that belongs to this entry point and
    not to the product's (``--mech-fault*``, ``--mech-record-routing``), naming this launcher; ``None`` when there is
    none. ``refused_by``: what refuses it (the product's launcher, ``megatron-mech train``)."""
    offered = study_flags()
    found = [name for name in (arg.split("=", 1)[0] for arg in flags if arg.startswith("--")) if name in offered]
    if not found:
        return None
    return (f"{found[0]} is a flag of the fault studies, not of {refused_by}; inject faults with the studies' "
            f"launcher: torchrun --nproc_per_node=N -m {ENTRY_MODULE} <the same flags>")


def main(argv=None) -> int:
    """Train with the fault flags offered; returns the entry point's exit code (see ``pretrain_gpt.main``)."""
    return train(argv, extension_types=EXTENSION_TYPES)


if __name__ == "__main__":
    sys.exit(main())
