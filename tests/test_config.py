"""MechConfig: each setting declared once, with its doc and flag; flags, dicts and validation agree."""
from __future__ import annotations

import argparse
import dataclasses

import pytest

from megatron_mech.config import DetectorOverrides, MechConfig, MoLSOptions, MonitorConfig, OutputConfig
from megatron_mech.studies.fault_config import FaultConfig

SECTIONS = (MonitorConfig, DetectorOverrides, MoLSOptions, OutputConfig, FaultConfig, MechConfig)


def _parser():
    return MechConfig.add_flags(argparse.ArgumentParser())


def test_every_field_is_documented_and_every_flag_is_generated_once():
    flags = [f.metadata.get("flag") for s in SECTIONS for f in dataclasses.fields(s)]
    for section in SECTIONS:
        for f in dataclasses.fields(section):
            assert f.metadata.get("doc"), f"{section.__name__}.{f.name} has no doc"
    declared = sorted(f for f in flags if f)
    assert len(declared) == len(set(declared))
    generated = sorted(o for a in _parser()._actions for o in a.option_strings if o.startswith("--mech"))
    assert generated == declared


def test_defaults_and_flags_match_the_dataclass_defaults():
    assert MechConfig.from_flags(_parser().parse_args([])) == MechConfig()
    args = _parser().parse_args(["--mech-interval", "5", "--mech-monitors", "attention", "--mech-qk-terms", "delta2",
                                 "--mech-no-checkpoint-snapshots", "--mech-mols", "--mech-mols-clamp", "0.25", "4",
                                 "--mech-mols-no-scale-weight-decay", "--mech-detector-baseline", "3",
                                 "--mech-on-alert", "stop", "--mech-fault", "attention", "--mech-fault-layers", "2", "0"])
    c = MechConfig.from_flags(args, tensorboard_dir="tb")
    assert (c.monitors.interval, c.monitors.families, c.monitors.qk_terms, c.monitors.checkpoint_snapshots) == \
        (5, ("attention",), ("delta2",), False)
    assert (c.mols.enabled, c.mols.clamp, c.mols.scale_weight_decay) == (True, (0.25, 4.0), False)
    assert (c.detector.as_rule_fields(), c.on_alert, c.output.tensorboard_dir) == ({"baseline": 3}, "stop", "tb")
    assert (c.fault.kind, c.fault.layers) == ("attention", (0, 2))
    assert MechConfig.from_flags(_parser().parse_args(["--mech-monitors"])).monitors.families == ()  # = none


def test_dict_round_trip_and_unknown_keys_are_named():
    c = MechConfig(monitors=MonitorConfig(interval=7, families=("attention", "router")), on_alert="checkpoint",
                   mols=MoLSOptions(enabled=True, classes=("qk", "vo")))
    d = c.to_dict()
    assert d["monitors"]["families"] == ["attention", "router"] and d["mols"]["classes"] == ["qk", "vo"]
    assert MechConfig.from_dict(d) == c
    assert MechConfig.from_dict({}) == MechConfig()
    with pytest.raises(ValueError, match=r"mech\.monitors: unknown key\(s\) 'intervall'"):
        MechConfig.from_dict({"monitors": {"intervall": 3}})
    with pytest.raises(ValueError, match=r"mech: unknown key\(s\) 'monitor'"):
        MechConfig.from_dict({"monitor": {}})
    with pytest.raises(ValueError, match="must be a mapping"):
        MechConfig.from_dict({"mols": 3})


@pytest.mark.parametrize("data, flag", [
    ({"monitors": {"interval": 0}}, "--mech-interval"),
    ({"monitors": {"dw_scope": "all"}}, "--mech-dw-scope"),
    ({"monitors": {"families": ["attention", "none"]}}, "--mech-monitors"),
    ({"detector": {"baseline": 2}}, "--mech-detector-baseline"),
    ({"on_alert": "panic"}, "--mech-on-alert"),
    ({"mols": {"clamp": [2, 4]}}, "clamp"),
    ({"fault": {"kind": "lr", "strength": -1}}, "strength"),
])
def test_bad_values_raise_once_naming_the_setting(data, flag):
    with pytest.raises(ValueError, match=flag):
        MechConfig.from_dict(data)


def test_monitor_resolution():
    assert MonitorConfig().resolve(has_routers=True) == ("attention", "router")
    assert MonitorConfig().resolve(has_routers=False) == ("attention",)
    with pytest.raises(ValueError, match="no MoE routers"):
        MonitorConfig(families=("router",)).resolve(has_routers=False)
