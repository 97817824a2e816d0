"""The studies' fault reaches a run only through the entry points that offer it (fast, no training).

The product's parsers know no ``--mech-fault*`` flag; the studies' megatron-core entry point and the Megatron-LM
call sites (once the fault launcher registers the injector) add exactly the flags FaultConfig declares, and the
injector the flags ask for is the one registered on the hook. The training runs through these entry points are
in tests/studies/test_faults.py, tests/integration/megatron_core/test_update_ratio_jump_training.py,
tests/integration/cli/test_demo.py, tests/integration/deepspeed/test_deepspeed.py (``fault``) and
tests/integration/megatron_lm/test_megatron_lm_e2e.py.
"""
import argparse
import dataclasses

import pytest

from megatron_mech.trainers.megatron_core.flags import build_parser
from megatron_mech.adapters.megatron_lm_fork import callsites
from megatron_mech.studies.fault_config import FaultConfig
from megatron_mech.studies.injectors import FaultInjector
from megatron_mech.studies.pretrain_gpt_fault import ENTRY_MODULE, check_flags

FAULT_FLAGS = sorted(f.metadata["flag"] for f in dataclasses.fields(FaultConfig))
ATTENTION = ["--mech-fault", "attention", "--mech-fault-strength", "0.1", "--mech-fault-layers", "1"]


def _fault_flags(parser):
    return sorted(o for a in parser._actions for o in a.option_strings if o.startswith("--mech-fault"))


def test_the_products_entry_point_has_no_fault_flag():
    assert _fault_flags(build_parser()) == []
    with pytest.raises(SystemExit):
        build_parser().parse_args(ATTENTION)


def test_the_studies_entry_point_offers_the_fault_and_checks_it_before_launching():
    cmd = ["torchrun", "-m", ENTRY_MODULE, "--num-layers", "4", "--num-attention-heads", "4"]
    assert check_flags([*cmd, *ATTENTION], 1) is None
    assert "FaultConfig.layers [7] out of range" in check_flags([*cmd, "--mech-fault", "attention",
                                                                 "--mech-fault-layers", "7"], 1)
    assert "FaultConfig.strength" in check_flags([*cmd, "--mech-fault", "lr", "--mech-fault-strength", "-2"], 1)
    parser = argparse.ArgumentParser()
    FaultInjector.add_arguments(parser)
    assert _fault_flags(parser) == FAULT_FLAGS
    injector = FaultInjector.from_args(parser.parse_args(ATTENTION))
    assert injector.config == FaultConfig(kind="attention", strength=0.1, layers=(1,))
    assert FaultInjector.from_args(parser.parse_args([])) is None  # no fault asked for: nothing registered


@pytest.fixture
def fresh_run(monkeypatch):
    monkeypatch.setattr(callsites, "RUN", callsites.MechRun())
    return callsites.RUN


def test_megatron_lm_call_sites_add_the_flags_of_registered_extensions_only(fresh_run):
    assert _fault_flags(callsites.extra_args_provider()(argparse.ArgumentParser())) == []
    callsites.register_extension(FaultInjector)
    callsites.register_extension(FaultInjector)  # once only
    assert fresh_run.extension_types == [FaultInjector]
    parser = callsites.extra_args_provider()(argparse.ArgumentParser())
    assert _fault_flags(parser) == FAULT_FLAGS
    assert parser.parse_args(ATTENTION).mech_fault == "attention"
    fresh_run.hook = object()  # the hook exists: too late to offer an extension
    with pytest.raises(RuntimeError, match="before the run starts"):
        callsites.register_extension(FaultInjector)
