"""The Python packages a training launch's flags ask for (``tensorboard`` for ``--tensorboard-dir``, ``wandb`` for
``--mech-wandb-project``), checked before anything is launched.

Every worker checks them at start-up (:func:`megatron_mech.trainers.megatron_core.pretrain_gpt.preflight`), but under
torchrun its one-line refusal comes out of every worker and ends under torchrun's ``ChildFailedError`` report. The
launchers check first: ``megatron-mech train`` (:mod:`megatron_mech.cli`) and ``launch_scripts/torchrun_multinode.sh``,
which runs ``python -m megatron_mech.trainers.megatron_core.sink_packages <training flags>``: exit 2 with one line on
stderr naming the flag and the package, exit 0 when nothing is missing.
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from megatron_mech.records.sinks import sink_start_problem

__all__ = ["SINK_FLAGS", "flags_problem", "sink_package_problem"]

#: (flag, sink kind) of each optional sink a training command line can ask for.
SINK_FLAGS = (("--tensorboard-dir", "tensorboard"), ("--mech-wandb-project", "wandb"))


def sink_package_problem(tensorboard_dir: Optional[str], wandb_project: Optional[str]) -> Optional[str]:
    """``"<flag> <value>: <why>"`` for the first sink asked for that cannot start: its package is missing, or (W&B)
    it would log online without an API key (:func:`~megatron_mech.records.sinks.sink_start_problem`); or None."""
    for (flag, kind), value in zip(SINK_FLAGS, (tensorboard_dir, wandb_project)):
        reason = sink_start_problem(kind) if value else None
        if reason:
            return f"{flag} {value}: {reason}"
    return None


def flags_problem(argv: Sequence[str]) -> Optional[str]:
    """:func:`sink_package_problem` of a training command line's flags (any other flag is ignored, so the check
    runs before the entry point's own parser, for megatron-core and for Megatron-LM forks alike)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for flag, _ in SINK_FLAGS:
        parser.add_argument(flag)
    known, _ = parser.parse_known_args(list(argv))
    return sink_package_problem(known.tensorboard_dir, known.mech_wandb_project)


def main(argv: Optional[Sequence[str]] = None) -> int:
    problem = flags_problem(sys.argv[1:] if argv is None else argv)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
