"""Skipped optimizer steps, named and counted: a DeepSpeed bf16 ZeRO-2 run on CPU whose gradients are non-finite
for 10 steps while its loss stays finite. DeepSpeed skips those steps and says nothing (``engine.skipped_steps``
counts them); the hook's alert names how many were skipped, the record carries the count and the run's total is
kept, with no precision diagnosis."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dist_utils import REPO_ROOT, free_port
from optional_packages import requires

pytestmark = [requires("deepspeed", "transformers"), pytest.mark.slow]

SCRIPT = '''
import json, math
import deepspeed
import torch

from megatron_mech.adapters.deepspeed.cpu import single_process_env, skip_shm_comm_build
from megatron_mech.adapters.deepspeed.engine import DeepSpeedMech
from megatron_mech.adapters.deepspeed.models import dense_llama

T = 30
ds_config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
             "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
             "zero_optimization": {"stage": 2},
             "mech": {"monitors": {"interval": 10}, "output": {"dir": "runs/ds"}}, **EXTRA}
single_process_env()
skip_shm_comm_build()
deepspeed.init_distributed(dist_backend="gloo")
model = dense_llama(vocab_size=256, hidden=16, layers=2, heads=2, kv_heads=1, ffn=32, seq_len=17)
done = {"steps": 0}
poisoned = model.model.layers[0].mlp.down_proj.weight
poisoned.register_hook(lambda g: torch.full_like(g, float("inf")) if FIRST <= done["steps"] < FIRST + 10 else g)
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
mech = DeepSpeedMech.from_engine(engine, train_steps=T)
for step in range(T):
    mech.before_step()
    batch = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(step))
    loss = engine(input_ids=batch, labels=batch).loss
    engine.backward(loss)
    engine.step()
    done["steps"] += 1
    mech.after_step(loss)
mech.close()
print("SKIPPED", engine.skipped_steps, mech.hook.skipped_steps.total)
'''


def _run(tmp_path, extra: dict, first: int) -> str:
    """The script with ``extra`` config keys and the gradients non-finite on the 10 steps from (0-based) ``first``;
    its output."""
    (tmp_path / "train.py").write_text(f"EXTRA = {extra!r}\nFIRST = {first}\n" + SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               MASTER_PORT=str(free_port()))
    run = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, env=env, text=True, capture_output=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    return run.stdout + run.stderr


def test_deepspeed_bf16_steps_skipped_on_nonfinite_gradients_are_named_and_counted(tmp_path):
    out = _run(tmp_path, {}, 10)
    assert "SKIPPED 10 10" in out   # DeepSpeed's own count, and the hook's
    records = {r["step"]: r for r in map(json.loads, (tmp_path / "runs" / "ds" / "mech.jsonl").read_text().splitlines())}
    skipped = {step: r["metrics"].get("symptom/optimizer_steps_skipped") for step, r in records.items()
               if step % 10 == 0}
    assert skipped == {10: None, 20: 10.0, 30: None}   # recorded where steps were skipped
    (alert,) = records[20]["alerts"]
    assert alert["metric"] == "symptom/optimizer_steps_skipped" and alert["value"] == 10
    line = ("[mech] ALERT step 20: optimizer steps skipped: 10 of the last 10 (steps 11-20); weights unchanged while "
            "the LR was > 0; 10 in the run so far")
    assert line in out
    assert "precision" not in line and "attention-precision" not in out


def test_with_gradient_clipping_the_nonfinite_grad_norm_of_a_skipped_step_is_diagnosed_as_the_skip(tmp_path):
    """With gradient clipping DeepSpeed also reports the step's grad norm, non-finite, on the first skipped step
    (here an evaluation step, 10): the step was refused and the weights kept their values, so the run's first
    diagnosis is the skip, not a global blow-up."""
    from megatron_mech.core.diagnosis import first_diagnosis
    from megatron_mech.records.sinks import read_alerts

    out = _run(tmp_path, {"gradient_clipping": 1.0}, 9)   # steps 10-19 (1-based) skipped
    assert "SKIPPED 10 10" in out
    alerts = read_alerts(tmp_path / "runs" / "ds" / "mech.jsonl")
    first = first_diagnosis(alerts)
    assert (first.step, first.cause) == (10, "optimizer_skipped")
    assert [(a.metric, a.value) for a in alerts if a.step == 10] == [("symptom/grad_norm", float("inf"))]
    records = {r["step"]: r for r in map(json.loads, (tmp_path / "runs" / "ds" / "mech.jsonl").read_text().splitlines())}
    assert records[10]["metrics"]["symptom/optimizer_step_skipped"] == 1.0   # the trainer's report, recorded
    assert "symptom/optimizer_step_skipped" not in records[30]["metrics"]
    assert "training went non-finite" not in out and "precision" not in out
    assert "[mech] ALERT step 10: optimizer steps skipped (the weights did not change) (grad-norm non-finite" in out
