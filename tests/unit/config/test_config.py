"""MechConfig: each setting declared once, with its doc and flag; flags, dicts and validation agree. The studies'
fault settings (FaultConfig) are declared with the same machinery but are not the product's: MechConfig knows
nothing of them, and the studies add their flags and split their ``"fault"`` key off a ``"mech"`` section."""
from __future__ import annotations

import argparse
import collections
import dataclasses
import pathlib
import re
from typing import Optional

import pytest

import megatron_mech
from megatron_mech.config import DetectorOverrides, MechConfig, MoLSOptions, MonitorConfig, OutputConfig
from megatron_mech.core.detect import DetectorConfig, LevelRules, TrendRules
from megatron_mech.core.mols import MoLSConfig
from megatron_mech.options import field_key, option, settings_of
from megatron_mech.studies.fault_config import FaultConfig, add_fault_arguments, split_fault_section

SECTIONS = (MonitorConfig, DetectorOverrides, MoLSOptions, OutputConfig, MechConfig)


def _parser():
    return MechConfig.add_flags(argparse.ArgumentParser())


def _generated(parser):
    return sorted(o for a in parser._actions for o in a.option_strings if o.startswith("--mech"))


def test_every_field_is_documented_and_every_flag_is_generated_once():
    flags = [f.metadata.get("flag") for s in SECTIONS for f in dataclasses.fields(s)]
    for section in (*SECTIONS, FaultConfig):
        for f in dataclasses.fields(section):
            assert f.metadata.get("doc"), f"{section.__name__}.{f.name} has no doc"
    declared = sorted(f for f in flags if f)
    assert len(declared) == len(set(declared))
    assert _generated(_parser()) == declared
    fault_flags = sorted(f.metadata["flag"] for f in dataclasses.fields(FaultConfig))
    assert _generated(add_fault_arguments(argparse.ArgumentParser())) == fault_flags
    assert not set(fault_flags) & set(declared)  # the product declares none of the studies' flags
    assert _generated(add_fault_arguments(_parser())) == sorted(declared + fault_flags)  # both in one parser


def test_defaults_and_flags_match_the_dataclass_defaults():
    assert MechConfig.from_flags(_parser().parse_args([])) == MechConfig()
    args = _parser().parse_args(["--mech-interval", "5", "--mech-monitors", "attention", "--mech-qk-terms", "delta2",
                                 "--mech-no-checkpoint-snapshots", "--mech-mols", "--mech-mols-clamp", "0.25", "4",
                                 "--mech-mols-no-scale-weight-decay", "--mech-detector-baseline", "3",
                                 "--mech-on-alert", "stop"])
    c = MechConfig.from_flags(args, tensorboard_dir="tb")
    assert (c.monitors.interval, c.monitors.families, c.monitors.qk_terms, c.monitors.checkpoint_snapshots) == \
        (5, ("attention",), ("delta2",), False)
    assert (c.mols.enabled, c.mols.clamp, c.mols.scale_weight_decay) == (True, (0.25, 4.0), False)
    assert (c.detector.as_rule_fields(), c.on_alert, c.output.tensorboard_dir) == ({"baseline": 3}, "stop", "tb")
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
    with pytest.raises(ValueError, match="mech.mols: expected a mapping"):
        MechConfig.from_dict({"mols": 3})


def test_a_key_given_twice_in_a_deepspeed_config_is_refused_naming_it(tmp_path):
    """JSON keeps the last of two equal keys: a config whose "mech" section said "interval" twice (or "mech"
    itself twice) ran with the second, the first dropped without a word. Refused naming the file and the key's
    path; the same keys once each are read as written."""
    from megatron_mech.adapters.deepspeed.ds_config_section import load_config_file, parse_section, read_section

    path = tmp_path / "ds_config.json"
    for text, key in (('{"mech": {"monitors": {"interval": 3, "families": ["attention"], "interval": 5}}}',
                       "mech.monitors.interval"),
                      ('{"mech": {"on_alert": "stop"}, "train_batch_size": 8, "mech": {}}', "mech"),
                      ('{"mech": {"detector": {"warmup": 4}, "detector": {"baseline": 9}}}', "mech.detector")):
        path.write_text(text)
        for read in (load_config_file, read_section):
            with pytest.raises(ValueError, match=f"DeepSpeed config {path}: key '{key}' appears twice"):
                read(str(path))
    path.write_text('{"train_batch_size": 8, "mech": {"monitors": {"interval": 3, "families": ["attention"]}}}')
    assert parse_section(read_section(str(path)))[0].monitors.interval == 3
    assert load_config_file(path) == {"train_batch_size": 8,
                                      "mech": {"monitors": {"interval": 3, "families": ["attention"]}}}


def test_misspelt_key_of_a_deepspeed_config_gets_the_closest_name(tmp_path):
    """A misspelt key in a DeepSpeed config file's "mech" section is refused naming its path and the closest
    valid key at its level, the DeepSpeed-only "deepspeed" subsection included; a key like none gets no guess."""
    import json

    from megatron_mech.adapters.deepspeed.ds_config_section import parse_section, read_section

    for section, message in (({"monitors": {"intervall": 5}}, "mech.monitors: unknown key(s) 'intervall' "
                                                              "(did you mean 'interval'?)"),
                             ({"mols": {"windw": 20}}, "mech.mols: unknown key(s) 'windw' (did you mean 'window'?)"),
                             ({"deepsped": {}}, "mech: unknown key(s) 'deepsped' (did you mean 'deepspeed'?)"),
                             ({"deepspeed": {"attention_layot": "auto"}},
                              "mech.deepspeed: unknown key(s) 'attention_layot' (did you mean 'attention_layout'?)"),
                             ({"monitors": {"zzz": 1}}, "mech.monitors: unknown key(s) 'zzz'; known keys:")):
        path = tmp_path / "ds_config.json"
        path.write_text(json.dumps({"train_batch_size": 8, "mech": section}))
        with pytest.raises(ValueError) as info:
            parse_section(read_section(str(path)))
        assert message in str(info.value), str(info.value)


def test_dict_round_trip_of_a_config_with_every_kind_of_field_set():
    """bool, int, float (given as an int), str, Optional, nargs lists of str/int/float, nested sections."""
    c = MechConfig(monitors=MonitorConfig(families=(), interval=3, dw_scope="slice", qk_terms=("delta1", "delta3"),
                                          all_linears=True, checkpoint_snapshots=False, experts=True),
                   detector=DetectorOverrides(warmup=2, baseline=4, threshold=3.5, persistence=2),
                   mols=MoLSOptions(enabled=True, window=7, window_start=3, base="qk", clamp=(0.25, 4.0),
                                    classes=("qk", "vo"), fixed=("qk=0.5",), diagnostic_steps=2),
                   output=OutputConfig(dir="runs/x", wandb_project="p", tensorboard_dir="tb"), on_alert="stop")
    assert MechConfig.from_dict(c.to_dict()) == c
    assert MechConfig.from_dict(MechConfig().to_dict()) == MechConfig()
    as_mapping = MechConfig(mols=MoLSOptions(enabled=True, fixed={"qk": 0.5}))  # Python's {class: mult} form
    assert as_mapping.mols.fixed == ("qk=0.5",) and MechConfig.from_dict(as_mapping.to_dict()) == as_mapping
    from_ints = MechConfig.from_dict({"mols": {"clamp": [1, 3]}, "detector": {"threshold": 2}})
    assert from_ints.mols.clamp == (1.0, 3.0) and isinstance(from_ints.mols.clamp[0], float)  # as the flags give
    assert isinstance(from_ints.detector.threshold, float)


_QK_TERMS = "'delta1', 'delta2', 'delta3'"


_BAD_VALUES = [
    ([], "mech: expected a mapping, got the list []"),
    ("mech", "mech: expected a mapping, got the string 'mech'"),
    ({"mols": {"enabled": "false"}}, "mech.mols.enabled: expected a boolean, got the string 'false'"),
    ({"mols": {"enabled": 1}}, "mech.mols.enabled: expected a boolean, got the integer 1"),
    ({"monitors": {"experts": "no"}}, "mech.monitors.experts: expected a boolean, got the string 'no'"),
    ({"monitors": {"checkpoint_snapshots": None}}, "mech.monitors.checkpoint_snapshots: expected a boolean, got None"),
    ({"monitors": {"interval": True}}, "mech.monitors.interval: expected an integer, got the boolean True"),
    ({"monitors": {"interval": 2.0}}, "mech.monitors.interval: expected an integer, got the number 2.0"),
    ({"monitors": {"interval": "5"}}, "mech.monitors.interval: expected an integer, got the string '5'"),
    ({"mols": {"window": "5"}}, "mech.mols.window: expected an integer or None, got the string '5'"),
    ({"detector": {"threshold": "1"}}, "mech.detector.threshold: expected a number or None, got the string '1'"),
    ({"detector": {"threshold": False}}, "mech.detector.threshold: expected a number or None, got the boolean False"),
    ({"output": {"dir": 5}}, "mech.output.dir: expected a path (a string without NUL bytes) or None, got the "
                             "integer 5"),
    ({"output": {"tensorboard_dir": ["tb"]}}, "mech.output.tensorboard_dir: expected a path (a string without NUL "
                                              "bytes) or None, got the list ['tb']"),
    ({"monitors": {"dw_scope": "all"}}, "mech.monitors.dw_scope: expected one of 'global', 'slice', got the string "
                                        "'all'"),
    ({"on_alert": "panic"}, "mech.on_alert: expected one of 'log', 'checkpoint', 'stop', got the string 'panic'"),
    ({"on_alert": None}, "mech.on_alert: expected one of 'log', 'checkpoint', 'stop', got None"),
    ({"mols": {"clamp": [1]}}, "mech.mols.clamp: expected a list of 2 numbers, got the list [1]"),
    ({"mols": {"clamp": [1, 2, 3]}}, "mech.mols.clamp: expected a list of 2 numbers, got the list [1, 2, 3]"),
    ({"mols": {"clamp": 2.0}}, "mech.mols.clamp: expected a list of 2 numbers, got the number 2.0"),
    ({"mols": {"clamp": [1, "2"]}}, "mech.mols.clamp[1]: expected a number, got the string '2'"),
    ({"monitors": {"qk_terms": []}}, f"mech.monitors.qk_terms: expected a list of one or more strings (each one of "
                                     f"{_QK_TERMS}), got the list []"),
    ({"monitors": {"qk_terms": "delta2"}}, f"mech.monitors.qk_terms: expected a list of one or more strings (each "
                                           f"one of {_QK_TERMS}), got the string 'delta2'"),
    ({"monitors": {"qk_terms": ["delta2", "delta4"]}}, f"mech.monitors.qk_terms[1]: expected one of {_QK_TERMS}, got "
                                                       f"the string 'delta4'"),
    ({"monitors": {"families": {"attention": True}}}, "mech.monitors.families: expected a list of strings (each one "
                                                      "of 'attention', 'router', 'auto', 'none'), got the mapping "
                                                      "{'attention': True}"),
    ({"mols": {"fixed": ["qk=0.5", 2]}}, "mech.mols.fixed[1]: expected a string, got the integer 2"),
    ({"mols": []}, "mech.mols: expected a mapping of MoLSOptions settings, got the list []"),
    ({"monitors": 0}, "mech.monitors: expected a mapping of MonitorConfig settings, got the integer 0"),
    ({"detector": "none"}, "mech.detector: expected a mapping of DetectorOverrides settings, got the string 'none'"),
]


@pytest.mark.parametrize("data, message", _BAD_VALUES, ids=[m.split(":")[0] for _, m in _BAD_VALUES])
def test_dict_values_of_the_wrong_type_are_named_by_key_path(data, message):
    with pytest.raises(ValueError) as info:
        MechConfig.from_dict(data)
    assert str(info.value) == message


def test_the_product_knows_no_fault_flag_nor_fault_key():
    with pytest.raises(SystemExit):
        _parser().parse_args(["--mech-fault", "attention"])
    with pytest.raises(ValueError, match=r"mech: unknown key\(s\) 'fault'"):
        MechConfig.from_dict({"fault": {"kind": "attention"}})
    assert "fault" not in MechConfig().to_dict()


def test_the_studies_split_their_fault_key_off_a_mech_section():
    section = {"monitors": {"interval": 5}, "fault": {"kind": "small_batch", "start": 5, "strength": 2,
                                                      "layers": [3, 0], "heads": [1]}}
    rest, fault = split_fault_section(section)
    assert rest == {"monitors": {"interval": 5}} and "fault" in section  # the caller's dict is left as it was
    assert fault == FaultConfig(kind="small_batch", start=5, strength=2, layers=(3, 0), heads=(1,))
    assert MechConfig.from_dict(rest) == MechConfig(monitors=MonitorConfig(interval=5))
    assert split_fault_section({"monitors": {}}) == ({"monitors": {}}, None)
    assert split_fault_section(None) == (None, None)
    # the same JSON shape round-trips through the fault's own dict
    assert split_fault_section({"fault": fault.to_dict()})[1] == fault


_BAD_FAULTS = [
    ({"fault": {"layers": [1, True]}}, "mech.fault.layers[1]: expected an integer, got the boolean True"),
    ({"fault": {"heads": 0}}, "mech.fault.heads: expected a list of one or more integers or None, got the integer 0"),
    ({"fault": {"kind": "lr", "strength": "4"}}, "mech.fault.strength: expected a number or None, got the string '4'"),
    ({"fault": {"kind": "bits"}}, "mech.fault.kind: expected one of 'none', 'attention', 'lr', 'small_batch', "
                                  "'combined', 'router', "
                                  "'router_input', 'data', 'skip', got the string 'bits'"),
    ({"fault": None}, "mech.fault: expected a mapping of FaultConfig settings, got None"),
    ({"fault": {"kind": "lr", "strength": -1}}, "FaultConfig.strength (LR multiplier k) must be > 0, got -1.0"),
]


@pytest.mark.parametrize("data, message", _BAD_FAULTS, ids=[m.split(":")[0] for _, m in _BAD_FAULTS])
def test_fault_values_of_the_wrong_type_are_named_by_key_path(data, message):
    with pytest.raises(ValueError) as info:
        split_fault_section(data)
    assert str(info.value) == message


@pytest.mark.parametrize("section, message", [
    ([], "mech: expected a mapping, got the list []"),
    ({"deepspeed": []}, "mech.deepspeed: expected a mapping, got the list []"),
    ({"deepspeed": 0}, "mech.deepspeed: expected a mapping, got the integer 0"),
    ({"deepspeed": None}, "mech.deepspeed: expected a mapping, got None"),
    ({"deepspeed": {"engine_monitor": 1}}, "mech.deepspeed.engine_monitor: expected a boolean, got the integer 1"),
    ({"deepspeed": {"attention_layout": "fused"}}, "mech.deepspeed.attention_layout: expected one of 'auto', "
                                                   "'separate', 'grouped', 'concatenated', got the string 'fused'"),
    ({"mols": {"enabled": "false"}}, "mech.mols.enabled: expected a boolean, got the string 'false'"),
])
def test_deepspeed_section_is_checked_by_the_same_declarations(section, message):
    from megatron_mech.adapters.deepspeed.ds_config_section import DeepSpeedOptions, parse_section

    with pytest.raises(ValueError) as info:
        parse_section(section)
    assert str(info.value) == message
    assert parse_section({"deepspeed": {}})[1] == DeepSpeedOptions()


@pytest.mark.parametrize("data, flag", [
    ({"monitors": {"interval": 0}}, "--mech-interval"),
    ({"monitors": {"families": ["attention", "none"]}}, "--mech-monitors"),
    ({"detector": {"baseline": 2}}, "--mech-detector-baseline"),
    ({"mols": {"clamp": [2, 4]}}, "clamp"),
    ({"monitors": {"router_token_stride": 0}}, "--mech-router-token-stride"),
])
def test_bad_values_raise_once_naming_the_setting(data, flag):
    with pytest.raises(ValueError, match=flag):
        MechConfig.from_dict(data)


def test_monitor_resolution():
    assert MonitorConfig().resolve(has_routers=True) == ("attention", "router")
    assert MonitorConfig().resolve(has_routers=False) == ("attention",)
    with pytest.raises(ValueError, match="no MoE routers"):
        MonitorConfig(families=("router",)).resolve(has_routers=False)


# The attention monitor's tuning settings: (field, its flag, a non-default value as typed on the command line, that
# value as parsed).
_ATTENTION_TUNING = [
    ("entropy_power", "--mech-entropy-power", "1.5", 1.5),
    ("bucket_mb", "--mech-bucket-mb", "0.25", 0.25),
    ("gram_dtype", "--mech-gram-dtype", "float64", "float64"),
    ("dw_route", "--mech-dw-route", "gram", "gram"),
    ("gram_max_dim", "--mech-gram-max-dim", "64", 64),
    ("krylov_steps", "--mech-krylov-steps", "12", 12),
    ("krylov_block", "--mech-krylov-block", "3", 3),
]


def _hook_attention_config(config):
    """The AttentionMonitorConfig of the monitor a MechHook builds from ``config`` on a one-layer model view."""
    import torch

    from megatron_mech.hook import MechHook
    from megatron_mech.model_view import ModelView
    from megatron_mech.monitors.attention import AttentionLayer

    heads, groups, head_dim, d_model = 2, 2, 4, 8
    weight = torch.zeros((heads + 2 * groups) * head_dim, d_model)
    hook = MechHook(config)
    hook.setup(ModelView(attention_layers=[AttentionLayer(0, weight, heads, groups, head_dim)]), start_step=0)
    return hook.monitor("attention").evaluator.config


@pytest.mark.parametrize("name, flag, typed, value", _ATTENTION_TUNING, ids=[t[0] for t in _ATTENTION_TUNING])
def test_attention_tuning_settings_round_trip_and_reach_the_monitor(name, flag, typed, value):
    from megatron_mech.monitors.attention import AttentionMonitorConfig

    default = {f.name: f.default for f in dataclasses.fields(AttentionMonitorConfig)}[name]
    assert getattr(MonitorConfig(), name) == default != value  # declared with the monitor's own default
    from_flags = MechConfig.from_flags(_parser().parse_args(["--mech-monitors", "attention", flag, typed]))
    assert getattr(from_flags.monitors, name) == value
    from_dict = MechConfig.from_dict({"monitors": {"families": ["attention"], name: value}})
    assert from_dict == from_flags and MechConfig.from_dict(from_flags.to_dict()) == from_flags
    assert from_flags.to_dict()["monitors"][name] == value
    built = _hook_attention_config(from_flags)
    assert type(built) is AttentionMonitorConfig and getattr(built, name) == value
    # every other monitor setting is the default's: the flag sets its own field only
    assert dataclasses.replace(built, **{name: default}) == _hook_attention_config(MechConfig())


_BAD_FLAGS = [
    (["--mech-entropy-power", "0"], "--mech-entropy-power: power must be a finite number > 0, got 0.0"),
    (["--mech-dw-route", "krylov", "--mech-entropy-power", "1"],
     "--mech-entropy-power: dw_route 'krylov' computes p ∝ σ² only; power must be 2, got 1.0"),
    (["--mech-bucket-mb", "-1"], "--mech-bucket-mb: bucket_mb must be None or a finite number > 0, got -1.0"),
    (["--mech-gram-max-dim", "0"], "--mech-gram-max-dim: gram_max_dim must be an int >= 1, got 0"),
    (["--mech-krylov-steps", "0"], "--mech-krylov-steps: krylov_steps must be an int >= 1, got 0"),
    (["--mech-krylov-block", "-2"], "--mech-krylov-block: krylov_block must be an int >= 1, got -2"),
    (["--mech-interval", "0"], "--mech-interval: interval must be an int >= 1, got 0"),
    (["--mech-qk-method", "qr", "--mech-qk-terms", "delta2", "delta2"],
     "--mech-qk-terms: qk_terms must be distinct terms from ('delta1', 'delta2', 'delta3'), got ('delta2', 'delta2')"),
]


@pytest.mark.parametrize("argv, message", _BAD_FLAGS, ids=[" ".join(argv) for argv, _ in _BAD_FLAGS])
def test_bad_attention_values_from_flags_name_their_flag(argv, message):
    with pytest.raises(ValueError) as info:
        MechConfig.from_flags(_parser().parse_args(argv))
    assert str(info.value) == message


@pytest.mark.parametrize("flag, typed", [("--mech-gram-dtype", "float16"), ("--mech-dw-route", "svd"),
                                         ("--mech-krylov-steps", "1.5"), ("--mech-entropy-power", "two")])
def test_attention_flags_of_the_wrong_type_or_choice_are_refused_by_the_parser(flag, typed, capsys):
    with pytest.raises(SystemExit):
        _parser().parse_args([flag, typed])
    err = capsys.readouterr().err
    assert f"argument {flag}: invalid" in err, err


_BAD_ATTENTION_KEYS = [
    ({"gram_dtype": "float16"}, "mech.monitors.gram_dtype: expected one of 'auto', 'float32', 'float64', got the "
                                "string 'float16'"),
    ({"dw_route": "svd"}, "mech.monitors.dw_route: expected one of 'auto', 'gram', 'krylov', got the string 'svd'"),
    ({"entropy_power": "2"}, "mech.monitors.entropy_power: expected a number, got the string '2'"),
    ({"bucket_mb": True}, "mech.monitors.bucket_mb: expected a number or None, got the boolean True"),
    ({"gram_max_dim": 4096.0}, "mech.monitors.gram_max_dim: expected an integer, got the number 4096.0"),
    ({"krylov_steps": "30"}, "mech.monitors.krylov_steps: expected an integer, got the string '30'"),
    ({"krylov_block": None}, "mech.monitors.krylov_block: expected an integer, got None"),
    ({"krylov_steps": 0}, "--mech-krylov-steps: krylov_steps must be an int >= 1, got 0"),  # a range: as the flag
]


@pytest.mark.parametrize("monitors, message", _BAD_ATTENTION_KEYS,
                         ids=[m.split(":")[0] for _, m in _BAD_ATTENTION_KEYS])
def test_bad_attention_values_from_a_dict_name_their_key_path(monitors, message):
    with pytest.raises(ValueError) as info:
        MechConfig.from_dict({"monitors": monitors})
    assert str(info.value) == message


def _declared_flags():
    """``{flag: [(file, line), ...]}`` of every ``option(..., flag="--mech-...")`` call in the package's source."""
    import ast

    from dist_utils import REPO_ROOT

    found = {}
    for path in sorted((REPO_ROOT / "megatron_mech").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "option":
                for kw in node.keywords:
                    if kw.arg == "flag" and isinstance(kw.value, ast.Constant) and kw.value.value:
                        found.setdefault(kw.value.value, []).append((path.relative_to(REPO_ROOT).as_posix(),
                                                                     node.lineno))
    return found


def test_every_attention_setting_is_declared_once_by_the_monitor():
    """The attention settings are the monitor's own declarations: MonitorConfig inherits each one (the same field
    object, not a copy under another name) and adds only the families and the other monitors' switches; across the
    package every --mech-* flag is declared by exactly one option(), and the monitors section's flags are those."""
    import megatron_mech.config as config_module
    from megatron_mech.monitors.attention import AttentionMonitorConfig, BadSetting

    monitor_fields = {f.name: f for f in dataclasses.fields(AttentionMonitorConfig)}
    section_fields = {f.name: f for f in dataclasses.fields(MonitorConfig)}
    assert all(section_fields.get(name) is f for name, f in monitor_fields.items())
    redeclared = set(vars(MonitorConfig).get("__annotations__", {})) & set(monitor_fields)
    assert not redeclared, f"MonitorConfig declares attention settings again: {sorted(redeclared)}"
    assert set(section_fields) - set(monitor_fields) == {"families", "all_linears", "experts", "router_token_stride",
                                                         "asynchronous", "async_timeout", "weights"}
    assert not hasattr(config_module, "ATTENTION_FIELDS")

    declared = _declared_flags()
    # the scan sees what it polices: the interval's one declaration, in the monitor's settings
    assert [path for path, _ in declared["--mech-interval"]] == ["megatron_mech/monitors/attention/settings.py"]
    twice = {flag: places for flag, places in declared.items() if len(places) > 1}
    assert not twice, f"flags declared more than once: {twice}"
    for name, f in section_fields.items():
        flag = f.metadata.get("flag")
        assert flag and flag in declared, f"MonitorConfig.{name}: flag {flag!r} is not an option() declaration"
        home = "monitors/attention/settings.py" if name in monitor_fields else "config.py"
        assert declared[flag][0][0] == f"megatron_mech/{home}", (name, declared[flag])

    with pytest.raises(BadSetting) as info:  # each check names its field, which is the section's field
        AttentionMonitorConfig(krylov_block=0)
    assert info.value.field == "krylov_block" and isinstance(info.value, ValueError)
    assert section_fields[info.value.field].metadata["flag"] == "--mech-krylov-block"


# ------------------------------------------------------------------------------------------------ MoLS and detector
def _core_settings(core):
    """The fields ``core`` declares as settings (with option()), by the key a config section gives them."""
    return {field_key(core, f.name): f for f in dataclasses.fields(core) if "doc" in f.metadata}


@pytest.mark.parametrize("section, core, name, own, prefix, help_of", [
    (MoLSOptions, MoLSConfig, "mols", ("enabled", "window_start"), "--mech-mols-", "{}"),
    (DetectorOverrides, DetectorConfig, "detector", ("max_logit_level", "expert_share_level",
                                                     "layer_trend_threshold", "layer_trend_window",
                                                     "layer_trend_warmup", "update_ratio_jump"),
     "--mech-detector-", "override the {} (default: per rule)"),
    (DetectorOverrides, LevelRules, "detector", ("warmup", "baseline", "threshold", "persistence",
                                                 "layer_trend_threshold", "layer_trend_window", "layer_trend_warmup",
                                                 "update_ratio_jump"),
     "--mech-", "{} (default: the rule's own level)"),
    (DetectorOverrides, TrendRules, "detector", ("warmup", "baseline", "threshold", "persistence",
                                                 "max_logit_level", "expert_share_level"),
     "--mech-", "{} (default: the rule's own)"),
], ids=["mols", "detector", "detector levels", "detector trends"])
def test_mols_and_detector_settings_are_declared_once_by_the_core(section, core, name, own, prefix, help_of):
    """The section's settings are the core's declarations: its fields besides its own are the core's settings in
    the core's order, its JSON keys are those and its own, each flag is the section's prefix and the key
    (``no-`` before it for a switch that turns a setting off), and each flag's help is the core field's doc, a
    ``{setting}`` in it written as that setting's flag."""
    settings = _core_settings(core)
    assert settings, f"{core.__name__} declares no setting"
    assert [f.name for f in dataclasses.fields(section) if f.name not in own] == list(settings)
    assert set(MechConfig().to_dict()[name]) == set(own) | set(settings)
    helps = {a.option_strings[0]: a.help for a in _parser()._actions if a.option_strings}
    ours = {f.name: f for f in dataclasses.fields(section)}
    flag_of = {f.name: ours[key].metadata["flag"] for key, f in settings.items()}
    for key, f in settings.items():
        flag = ours[key].metadata["flag"]
        assert flag == prefix + ("no-" if f.metadata.get("inverted") else "") + key.replace("_", "-")
        assert f.metadata.get("flag") in (None, flag)  # a core declaration that still names its flag agrees
        doc = re.sub(r"\{(\w+)\}", lambda m: flag_of.get(m.group(1), m.group(0)), f.metadata["doc"])
        assert helps[flag].replace("%%", "%") == help_of.format(doc)
        default = f.default if help_of == "{}" else None  # an override keeps the rule's value by default
        assert getattr(section(), key) == default


def test_every_flag_is_declared_once_in_the_package():
    """A flag is written once, in an option() outside the math core; a core setting's flag is not written at all
    (its section derives it from its prefix)."""
    root = pathlib.Path(megatron_mech.__file__).parent
    found = collections.Counter(flag for path in root.rglob("*.py")
                                for flag in re.findall(r'flag="(--mech-[a-z0-9-]+)"', path.read_text()))
    assert found["--mech-interval"] == 1 and found["--mech-mols-window-start"] == 1
    assert found["--mech-mols-window"] == 0 and "--mech-mols-window" in _generated(_parser())
    assert found["--mech-detector-threshold"] == 0 and "--mech-detector-threshold" in _generated(_parser())
    assert [flag for flag, n in found.items() if n > 1] == []


def test_a_derived_flag_names_the_settings_flag_the_doc_refers_to_and_must_agree_with_a_declared_one():
    """A section's prefix gives each core setting its flag: ``{name}`` in a doc becomes the flag of the setting
    ``name``, other braces stay; a core setting that still declares a flag other than the derived one is refused,
    naming both."""
    @dataclasses.dataclass
    class Core:
        rate: float = option(1.0, "step size", type=float, key="lr")
        steps: int = option(3, "steps of {rate} at layer{L}", type=int)
        safe: bool = option(True, "stay safe", inverted=True)

    @dataclasses.dataclass
    @settings_of(Core, flag_prefix="--mech-toy-")
    class Section:
        pass

    flags = {f.name: (f.metadata["flag"], f.metadata["doc"]) for f in dataclasses.fields(Section)}
    assert flags == {"lr": ("--mech-toy-lr", "step size"), "steps": ("--mech-toy-steps", "steps of --mech-toy-lr at "
                                                                                         "layer{L}"),
                     "safe": ("--mech-toy-no-safe", "stay safe")}
    assert all(f.metadata.get("flag") is None for f in dataclasses.fields(Core))  # the core's own stay flagless

    @dataclasses.dataclass
    class Declared:
        rate: float = option(1.0, "step size", flag="--mech-rate", type=float)

    with pytest.raises(TypeError, match="Declared.rate declares the flag --mech-rate; its section's prefix "
                                        "'--mech-toy-' gives it --mech-toy-rate"):
        @dataclasses.dataclass
        @settings_of(Declared, flag_prefix="--mech-toy-")
        class Disagrees:
            pass


def test_a_section_cannot_declare_a_core_setting_again():
    with pytest.raises(TypeError, match=r"declares \['window'\] again; MoLSConfig declares them"):
        @dataclasses.dataclass
        @settings_of(MoLSConfig)
        class Twice:
            window: Optional[int] = option(None, "estimation window", flag="--mech-mols-window", type=int)


_EVERY_MOLS_SETTING = dict(enabled=True, window=4, window_start=3, base="qk", clamp=(0.25, 4.0), samples=3,
                           fused_qkv_rule="qk", classes=("qk", "vo"), min_ramp=2, scale_weight_decay=False,
                           fixed=("qk=0.5",), diagnostic_interval=8, diagnostic_steps=2)
_EVERY_MOLS_FLAG = ["--mech-mols", "--mech-mols-window", "4", "--mech-mols-window-start", "3", "--mech-mols-base", "qk",
                    "--mech-mols-clamp", "0.25", "4", "--mech-mols-samples", "3", "--mech-mols-fused-qkv-rule", "qk",
                    "--mech-mols-classes", "qk", "vo", "--mech-mols-min-ramp", "2",
                    "--mech-mols-no-scale-weight-decay", "--mech-mols-fixed", "qk=0.5",
                    "--mech-mols-diagnostic-interval", "8", "--mech-mols-diagnostic-steps", "2",
                    "--mech-detector-warmup", "2", "--mech-detector-baseline", "4", "--mech-detector-threshold", "3.5",
                    "--mech-detector-persistence", "2"]


def test_every_mols_and_detector_setting_round_trips_and_reaches_the_core():
    mols = MoLSOptions(**_EVERY_MOLS_SETTING)
    # every setting but the estimator differs from its default (the diagnostic needs the default two_batch)
    assert [f.name for f in dataclasses.fields(MoLSOptions)
            if getattr(mols, f.name) == getattr(MoLSOptions(), f.name)] == ["estimator"]
    c = MechConfig(mols=mols, detector=DetectorOverrides(warmup=2, baseline=4, threshold=3.5, persistence=2))
    assert MechConfig.from_dict(c.to_dict()) == c
    assert MechConfig.from_flags(_parser().parse_args(_EVERY_MOLS_FLAG)) == c
    assert MechConfig.from_dict(MechConfig.from_flags(_parser().parse_args([])).to_dict()) == MechConfig()
    # the core gets each setting under its own name, the first step as it is (steps count from 1 in both)
    assert mols.core_config(train_steps=100, ramp_end=20) == MoLSConfig(
        window_steps=4, window_start=3, base="qk", clamp=(0.25, 4.0), num_samples=3, fused_qkv_rule="qk",
        classes=("qk", "vo"), min_ramp_steps=2, scale_weight_decay=False, fixed_multipliers={"qk": 0.5},
        diagnostic_interval=8, diagnostic_steps=2, ramp_end=20)
    rules = DetectorConfig(**c.detector.as_rule_fields())
    assert (rules.warmup, rules.baseline, rules.threshold, rules.persistence) == (2, 4, 3.5, 2)


def test_run_dependent_mols_values_are_filled_in_by_core_config():
    default = MoLSOptions(enabled=True)
    assert (default.core_config(train_steps=1000, ramp_end=50).window_steps,
            default.core_config(train_steps=1000, ramp_end=50).ramp_end) == (10, 50)  # 1% of 1000
    assert default.core_config(train_steps=100, ramp_end=None).window_steps == 5  # at least 5
    assert MoLSOptions(window_start=1).core_config(train_steps=100, ramp_end=None).window_start == 1
    assert MoLSOptions(window_start=0).core_config(train_steps=100, ramp_end=None).window_start == 1  # the first
    with pytest.raises(ValueError, match=r"--mech-mols needs the number of training steps"):
        default.core_config(train_steps=None, ramp_end=None)
    with pytest.raises(ValueError) as info:
        MoLSOptions(window=5, window_start=4).core_config(train_steps=7, ramp_end=None)
    assert str(info.value) == "--mech-mols-window: the estimation window (steps 4..8) does not fit in --train-iters 7"


_BAD_MOLS = [
    (["--mech-mols-window", "0"], {"mols": {"window": 0}},
     "--mech-mols-window: MoLSConfig.window_steps must be >= 1, got 0 (an empty estimation window)"),
    (["--mech-mols-samples", "1"], {"mols": {"samples": 1}},
     "--mech-mols-samples: MoLSConfig.num_samples must be >= 2, got 1"),
    (["--mech-mols-min-ramp", "-1"], {"mols": {"min_ramp": -1}},
     "--mech-mols-min-ramp: MoLSConfig.min_ramp_steps must be >= 0, got -1"),
    (["--mech-mols-clamp", "3", "4"], {"mols": {"clamp": [3, 4]}},
     "--mech-mols-clamp: MoLSConfig.clamp must satisfy 0 < min <= 1 <= max < inf, got (3.0, 4.0)"),
    (["--mech-mols-classes", "qk", "qk"], {"mols": {"classes": ["qk", "qk"]}},
     "--mech-mols-classes: MoLSConfig.classes has duplicates: ('qk', 'qk')"),
    (["--mech-mols-diagnostic-interval", "4", "--mech-mols-diagnostic-steps", "5"],
     {"mols": {"diagnostic_interval": 4, "diagnostic_steps": 5}},
     "--mech-mols-diagnostic-steps: MoLSConfig.diagnostic_steps (5) must not exceed diagnostic_interval (4)"),
    (["--mech-mols-diagnostic-interval", "4", "--mech-mols-estimator", "samples"],
     {"mols": {"diagnostic_interval": 4, "estimator": "samples"}},
     "--mech-mols-diagnostic-interval: MoLSConfig.diagnostic_interval needs estimator='two_batch' (the samples "
     "estimator would cost K extra passes per diagnostic step)"),
    (["--mech-mols-window-start", "-2"], {"mols": {"window_start": -2}},
     "--mech-mols-window-start must be an integer >= 0, got -2"),
    (["--mech-mols-fixed", "qk=0"], {"mols": {"fixed": ["qk=0"]}},
     "--mech-mols-fixed: MoLSConfig.fixed_multipliers['qk'] must be a positive finite number, got 0.0"),
    (["--mech-detector-threshold", "-1"], {"detector": {"threshold": -1}},
     "--mech-detector-threshold: threshold must be a finite number > 0, got -1.0"),
    (["--mech-detector-warmup", "-1"], {"detector": {"warmup": -1}},
     "--mech-detector-warmup: warmup must be an int >= 0, got -1"),
]


@pytest.mark.parametrize("argv, data, message", _BAD_MOLS, ids=[" ".join(argv) for argv, _, _ in _BAD_MOLS])
def test_bad_mols_and_detector_values_name_their_flag_from_flags_and_from_a_dict(argv, data, message):
    """The core's checks name their field (BadSetting.field); the configuration names the flag, whichever way the
    value came (a range is checked once, by the core, so a dict key's error names the flag too)."""
    with pytest.raises(ValueError) as info:
        MechConfig.from_flags(_parser().parse_args(argv))
    assert str(info.value) == message
    with pytest.raises(ValueError) as info:
        MechConfig.from_dict(data)
    assert str(info.value) == message


@pytest.mark.slow
def test_a_path_with_a_nul_byte_is_refused_where_it_is_set_naming_it(tmp_path):
    """No path may hold a NUL byte (the OS call fails with "embedded null byte", naming nothing): a DeepSpeed
    config file's ``mech.output.dir`` is refused by the example launcher before anything is built, naming the key;
    the other path settings are refused by key, by flag or, built in Python, by both."""
    import json
    import subprocess
    import sys

    from megatron_mech.adapters.deepspeed.ds_config_section import parse_section, read_section

    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2,
                                  "mech": {"output": {"dir": str(tmp_path / "runs\0x")}}}))
    out = subprocess.run([sys.executable, "-m", "megatron_mech.trainers.deepspeed.train", "--deepspeed-config", str(config),
                          "--output-dir", str(tmp_path / "out"), "--steps", "2"], cwd=pathlib.Path(__file__).parents[3],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-3000:]
    assert out.stderr.startswith("deepspeed_train: error: mech.output.dir: expected a path (a string without NUL "
                                 "bytes) or None"), out.stderr[-3000:]
    assert not (tmp_path / "out").exists()  # refused before any directory was made
    section = read_section(str(config))
    section["output"] = {"tensorboard_dir": "tb\0"}
    with pytest.raises(ValueError, match=r"^mech\.output\.tensorboard_dir: expected a path"):
        parse_section(section)
    with pytest.raises(ValueError, match=r"^mech\.output\.dir \(--mech-output-dir\): a path cannot hold a NUL byte"):
        MechConfig(output=OutputConfig(dir="runs\0x"))
    with pytest.raises(SystemExit):
        _parser().parse_args(["--mech-output-dir", "runs\0x"])
    assert parse_section({"output": {"dir": "runs/x"}})[0].output.dir == "runs/x"  # an ordinary path is kept


def test_weights_setting_is_master_by_default_and_refuses_other_values():
    """--mech-weights / "mech": {"monitors": {"weights"}} chooses the weights the monitors difference."""
    assert MechConfig().monitors.weights == "master"
    assert MechConfig.from_dict({"monitors": {"weights": "model"}}).monitors.weights == "model"
    with pytest.raises(ValueError, match="weights"):
        MechConfig.from_dict({"monitors": {"weights": "bf16"}})
