"""The DeepSpeed launcher with the studies' fault (:mod:`megatron_mech.trainers.deepspeed.train` plus a fault)::

    torchrun --nproc_per_node=2 -m megatron_mech.studies.deepspeed_fault_train --fault-start 20 --steps 40

Everything of the product's launcher, plus ``--fault-start N`` (the attention fault: emulated FlashAttention-2
backward with γ = 0.3 in layer 1 from step N, with detector baselines short enough for a short run) and a
``--deepspeed-config`` whose ``"mech"`` section holds a ``"fault"`` key (the fields of
:class:`~megatron_mech.studies.fault_config.FaultConfig`). The fault is split off the config before the product
sees it and registered on the hook as a :class:`~megatron_mech.studies.injectors.FaultInjector` extension, through
the launcher's ``main(study=...)`` seam.
"""
from __future__ import annotations

import argparse
import sys

from megatron_mech.adapters.deepspeed.ds_config_section import parse_section
from megatron_mech.studies.deepspeed_faults import refuse_lr_fault_without_scheduler
from megatron_mech.studies.injectors import injector_from_section
from megatron_mech.trainers.deepspeed import train as product_launcher

__all__ = ["AttentionFaultStudy", "main"]

FAULT_STRENGTH = 0.3  # γ of the emulated FlashAttention-2 backward: collapses the attention within ~100 steps
FAULT_LAYERS = [1]
SHORT_DETECTOR = {"warmup": 2, "baseline": 4, "persistence": 2}  # a short run's baselines (a 40-step run evaluates 8×)


class AttentionFaultStudy:
    """What this launcher adds to the product's: the ``--fault-start`` flag and the config's ``"fault"`` key."""

    @staticmethod
    def add_flags(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--fault-start", type=int, default=None,
                            help=f"inject the attention fault (emulated FA2 backward, γ={FAULT_STRENGTH}) in layer "
                                 f"{FAULT_LAYERS[0]} from this step (sets short detector baselines)")

    @staticmethod
    def extensions(args, config: dict) -> list:
        """Takes ``mech.fault`` out of ``config`` (``--fault-start`` writes one) and returns its injector; raises
        ``ValueError`` naming the key for a bad fault, or for an LR fault without an lr scheduler (the fault
        multiplies each step's scheduled lr; without one it would compound every step)."""
        section = config.setdefault("mech", {})
        if args.fault_start is not None:
            if not isinstance(section, dict):
                raise ValueError(f"mech: expected a mapping, got {type(section).__name__}")
            section.setdefault("detector", dict(SHORT_DETECTOR))
            section["fault"] = {"kind": "attention", "start": args.fault_start, "strength": FAULT_STRENGTH,
                                "layers": FAULT_LAYERS}
        rest, injector = injector_from_section(section)
        config["mech"] = rest if rest is not None else {}
        refuse_lr_fault_without_scheduler(injector, "scheduler" in config,
                                          parse_section(config["mech"])[0].mols.enabled)
        return [injector] if injector is not None else []


def main(argv=None) -> int:
    """The product's launcher with the fault offered; returns its exit code."""
    return product_launcher.main(argv, study=AttentionFaultStudy())


if __name__ == "__main__":
    sys.exit(main())
