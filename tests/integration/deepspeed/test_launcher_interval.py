"""The DeepSpeed launcher offers ``--mech-interval`` as the config declares it (one declaration: its default, type
and help come from ``MonitorConfig.interval``), and reports on the steps the hook evaluates; a config it cannot run
as written (a key given twice, a W&B sink that cannot log in) is refused before anything is built."""
from __future__ import annotations

import argparse
import ast
import dataclasses
import sys

import pytest

from dist_utils import REPO_ROOT
from megatron_mech.config import MonitorConfig
from megatron_mech.options import add_section_flags

pytestmark = pytest.mark.timeout(120)
LAUNCHER = REPO_ROOT / "megatron_mech" / "trainers" / "deepspeed" / "train.py"


def _launcher():
    from megatron_mech.trainers.deepspeed import train

    return train


def test_the_launcher_declares_no_interval_flag_of_its_own():
    strings = {node.value for node in ast.walk(ast.parse(LAUNCHER.read_text(encoding="utf-8")))
               if isinstance(node, ast.Constant) and isinstance(node.value, str)}
    assert "--mech-interval" not in strings


def test_the_launcher_flag_is_the_configs_declaration():
    field = {f.name: f for f in dataclasses.fields(MonitorConfig)}["interval"]
    launcher = _launcher()
    assert launcher.parse_args([]).mech_interval == MonitorConfig().interval == field.default
    assert launcher.parse_args(["--mech-interval", "3"]).mech_interval == 3
    with pytest.raises(SystemExit):
        launcher.parse_args(["--mech-interval", "three"])
    reference = argparse.ArgumentParser()
    add_section_flags(reference, MonitorConfig)
    ours = argparse.ArgumentParser()
    add_section_flags(ours, MonitorConfig, only=("interval",))
    (action,) = [a for a in ours._actions if "--mech-interval" in a.option_strings]
    (expected,) = [a for a in reference._actions if "--mech-interval" in a.option_strings]
    assert (action.default, action.type, action.help) == (expected.default, expected.type, expected.help)
    assert [a.dest for a in ours._actions if a.dest != "help"] == ["mech_interval"]


def test_only_names_a_field_the_section_has():
    with pytest.raises(ValueError, match=r"MonitorConfig has no field \['intervall'\]"):
        add_section_flags(argparse.ArgumentParser(), MonitorConfig, only=("intervall",))


def test_the_launcher_refuses_a_config_giving_the_interval_twice(tmp_path, capsys):
    """``--deepspeed-config`` with ``"interval"`` twice in its "mech" section ran with the last one, the user's
    first setting dropped silently. The launcher refuses it before building anything (exit 2, naming the key)."""
    config = tmp_path / "ds.json"
    config.write_text('{"train_micro_batch_size_per_gpu": 2, "mech": {"monitors": {"interval": 3, "interval": 7}}}')
    assert _launcher().main(["--deepspeed-config", str(config), "--output-dir", str(tmp_path / "out")]) == 2
    assert (f"deepspeed_train: error: DeepSpeed config {config}: key 'mech.monitors.interval' appears twice"
            in capsys.readouterr().err)
    assert not (tmp_path / "out").exists()


def test_the_launcher_refuses_wandb_online_without_a_key_before_building(tmp_path, monkeypatch, capsys):
    """``mech.output.wandb_project`` with W&B online and no API key failed only once the engine was built. The
    launcher refuses it first (exit 2, naming the key and the settings; no login attempt, no network)."""
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_MODE", "WANDB_BASE_URL", "WANDB_CONFIG_DIR",
                 "NETRC"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    config = tmp_path / "ds.json"
    config.write_text('{"train_micro_batch_size_per_gpu": 2, "mech": {"output": {"wandb_project": "p"}}}')
    assert _launcher().main(["--deepspeed-config", str(config), "--output-dir", str(tmp_path / "out")]) == 2
    assert ("deepspeed_train: error: mech.output.wandb_project p: W&B would log online (WANDB_MODE=unset) but no "
            "API key is set up for api.wandb.ai" in capsys.readouterr().err)
    assert not (tmp_path / "out").exists()
