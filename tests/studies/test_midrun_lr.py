"""The mid-run LR benchmark's plumbing: the raised run is the twin's command plus the LR change only, and every
rule is counted from the change on (before it the two runs are the same run)."""
from __future__ import annotations

import argparse

from benchmarks import early_warning, midrun_lr
from megatron_mech.core.detect import Alert
from megatron_mech.studies.fault_config import FaultConfig, add_fault_arguments
from megatron_mech.studies.pretrain_gpt_fault import ENTRY_MODULE


def test_the_raised_run_is_the_twin_plus_the_lr_change(tmp_path):
    args = argparse.Namespace(steps=500, start=300, factor=100.0, ramp=100, runs_dir=str(tmp_path))
    cmds = midrun_lr.commands(21, args)
    clean, raised = cmds["clean"], cmds["lr"]
    assert "--mech-fault" not in clean
    # the same flags, with the run's own folders, then the fault flags
    swapped = [item.replace(str(tmp_path / "s21" / "clean"), str(tmp_path / "s21" / "lr")) for item in clean]
    assert raised[:len(clean)] == swapped and str(tmp_path / "s21" / "lr") in raised
    flags, _ = add_fault_arguments(argparse.ArgumentParser()).parse_known_args(raised[raised.index(ENTRY_MODULE) + 1:])
    fault = FaultConfig.from_args(flags)
    assert (fault.kind, fault.strength, fault.ramp, fault.start) == ("lr", 100.0, 100, 300)


def test_rules_are_counted_from_the_change():
    steps = [5 * (i + 1) for i in range(60)]  # 300 steps, a record every 5
    grad_norms = [1.0] * 60
    grad_norms[9] = 30.0  # step 50: over the level 20, before the change
    grad_norms[49] = 30.0  # step 250: after it
    run = {"dir": "run", "losses": [3.0] * 300, "grad_norm": (steps, grad_norms), "max_logit": (steps, [10.0] * 60),
           "alerts": [Alert("router/layer0/entropy_mean", "router", 40, 1.0, 1.3, 6.5),
                      Alert("router/layer0/entropy_mean", "router", 260, 0.5, 1.3, 9.0)]}
    whole = early_warning.rule_firings(run, 20.0)
    assert whole["grad norm > 20"] == 50 and whole["router monitor"] == 40
    since = early_warning.rule_firings(run, 20.0, from_step=200)
    assert since["grad norm > 20"] == 250 and since["router monitor"] == 260
