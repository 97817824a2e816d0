"""Faults come only through the studies' DeepSpeed launcher (``-m megatron_mech.studies.deepspeed_fault_train``):
the product's launcher (``megatron_mech.trainers.deepspeed.train``) has no fault flag and refuses a config's
``mech.fault`` naming the key and the launcher that takes it; the study launcher splits the fault off the config
before the product sees it, registers it as a hook extension, and a short run with it alerts on the faulty layer."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

from dist_utils import REPO_ROOT
from optional_packages import requires

STUDY_MODULE = "megatron_mech.studies.deepspeed_fault_train"
TINY = ("--mech-interval", "2", "--hidden", "16", "--layers", "2", "--heads", "2", "--kv-heads", "1", "--seq-len", "16",
        "--micro-batch", "2")


def _product():
    from megatron_mech.trainers.deepspeed import train

    return train


@pytest.mark.timeout(120)
def test_the_product_launcher_has_no_fault_flag():
    with pytest.raises(SystemExit) as exc:
        _product().parse_args(["--fault-start", "5"])
    assert exc.value.code == 2  # argparse: unrecognized argument


@pytest.mark.timeout(120)
def test_the_product_launcher_refuses_a_fault_key_naming_it_and_the_study_launcher(tmp_path, capsys):
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2,
                                  "mech": {"output": {"dir": str(tmp_path / "mech")},
                                           "fault": {"kind": "attention", "start": 5}}}))
    code = _product().main(["--deepspeed-config", str(config), "--output-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "mech.fault" in err and STUDY_MODULE in err, err
    assert not (tmp_path / "out").exists()  # refused before anything was claimed or written


@pytest.mark.timeout(120)
def test_the_study_takes_its_fault_out_of_the_config_and_returns_its_injector():
    from megatron_mech.studies.deepspeed_fault_train import FAULT_STRENGTH, AttentionFaultStudy
    from megatron_mech.studies.injectors import FaultInjector

    parser = argparse.ArgumentParser()
    AttentionFaultStudy.add_flags(parser)
    config = {"scheduler": {"type": "WarmupLR"}, "mech": {"monitors": {"interval": 2}}}
    (injector,) = AttentionFaultStudy.extensions(parser.parse_args(["--fault-start", "7"]), config)
    assert isinstance(injector, FaultInjector)
    assert (injector.config.kind, injector.config.start, injector.config.strength, list(injector.config.layers)) == \
        ("attention", 7, FAULT_STRENGTH, [1])
    assert "fault" not in config["mech"] and config["mech"]["monitors"] == {"interval": 2}
    assert config["mech"]["detector"]["baseline"] == 4  # a short run's baselines come with the flag

    # a study config's own "fault" key (no flag) is split off the same way
    config = {"scheduler": {}, "mech": {"fault": {"kind": "small_batch", "start": 3, "strength": 2}}}
    (injector,) = AttentionFaultStudy.extensions(parser.parse_args([]), config)
    assert injector.config.kind == "small_batch" and config["mech"] == {}
    # no fault: nothing registered, the config unchanged
    config = {"mech": {"monitors": {"interval": 2}}}
    assert AttentionFaultStudy.extensions(parser.parse_args([]), config) == []
    assert config == {"mech": {"monitors": {"interval": 2}}}


@pytest.mark.timeout(120)
def test_an_lr_fault_without_a_scheduler_is_refused_naming_the_key():
    from megatron_mech.studies.deepspeed_fault_train import AttentionFaultStudy

    parser = argparse.ArgumentParser()
    AttentionFaultStudy.add_flags(parser)
    with pytest.raises(ValueError, match=r"mech.fault kind 'lr' needs an lr scheduler"):
        AttentionFaultStudy.extensions(parser.parse_args([]), {"mech": {"fault": {"kind": "lr", "start": 3}}})
    # with MoLS (its scheduler wrapper sets each step's lr) it is accepted
    (injector,) = AttentionFaultStudy.extensions(
        parser.parse_args([]), {"mech": {"mols": {"enabled": True}, "fault": {"kind": "lr", "start": 3}}})
    assert injector.config.kind == "lr"


@requires("deepspeed", "transformers")
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_short_run_of_the_study_launcher_alerts_on_the_faulty_layer(tmp_path):
    """The real launcher (one gloo process, a 2-layer Llama, ZeRO 2): the attention fault from step 10 in layer 1
    gives an attention alert on layer 1 after step 10; the records carry no fault key of their own."""
    from dist_utils import free_port

    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               MASTER_PORT=str(free_port()))
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, "-m", STUDY_MODULE, *TINY, "--steps", "40", "--warmup", "5",
                             "--fault-start", "10", "--output-dir", str(out)], env=env, cwd=REPO_ROOT, text=True,
                            capture_output=True, timeout=540)
    assert result.returncode == 0, result.stderr[-4000:]
    alerts = [(record["step"], alert) for line in (out / "mech.jsonl").read_text().splitlines()
              for record in [json.loads(line)] for alert in record.get("alerts", [])]
    attention = [(step, alert) for step, alert in alerts if alert["metric"].startswith("attn/")]
    assert attention, alerts
    assert min(step for step, _ in attention) > 10
    assert any(alert.get("layer") == 1 or "layer1" in alert["metric"] for _, alert in attention), attention
