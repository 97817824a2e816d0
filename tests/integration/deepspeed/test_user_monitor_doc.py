"""The user-monitor example of docs/extending.md, extracted verbatim and run on a real DeepSpeed training run (one
CPU process, an HF Llama of two decoder layers): its metrics reach ``mech.jsonl`` on the evaluation steps only, with
the values an independent forward pass gives, and its state is checkpointed under its name and loaded back on a
resume."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from dist_utils import REPO_ROOT, free_port
from optional_packages import requires

pytestmark = [requires("deepspeed", "transformers"), pytest.mark.slow]  # a DeepSpeed run in a subprocess

DOC = REPO_ROOT / "docs" / "extending.md"


def example(name: str) -> str:
    """The ``python`` block right after ``<!-- example:name -->`` in docs/extending.md."""
    text = DOC.read_text(encoding="utf-8")
    match = re.search(rf"<!-- example:{re.escape(name)} -->\n```python\n(.*?)```", text, flags=re.S)
    assert match, f"docs/extending.md has no ```python block after <!-- example:{name} -->"
    return match.group(1)


# The training around the example: the DeepSpeed guide's loop, cut to the bone. Before each evaluation step's
# training forward (and before before_step arms the monitor, so the example does not see it) a no-grad forward of
# the same batch with the same weights gives the reference: HF's hidden_states[1] is decoder layer 0's output.
DRIVER = '''
import json, sys
import deepspeed, torch
from megatron_mech.adapters.deepspeed.cpu import single_process_env, skip_shm_comm_build
from megatron_mech.adapters.deepspeed.engine import DeepSpeedMech, load_checkpoint, save_checkpoint
from megatron_mech.adapters.deepspeed.models import dense_llama
from activation_norms import ActivationNorms

T, RESUME = int(sys.argv[1]), sys.argv[2] == "resume"
ds_config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
             "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
             "zero_optimization": {"stage": 0},
             "mech": {"monitors": {"interval": 2}, "output": {"dir": "runs/ds"}}}
single_process_env()
skip_shm_comm_build()
deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(0)
model = dense_llama(vocab_size=256, hidden=16, layers=2, heads=2, kv_heads=1, ffn=32, seq_len=17)
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
%(registration)s
if RESUME:
    load_checkpoint(engine, mech, "ckpt")
reference = {}
for step in range(engine.global_steps, T):
    batch = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(step))
    if (step + 1) %% 2 == 0:
        with torch.no_grad():
            hidden = engine.module(input_ids=batch, output_hidden_states=True).hidden_states[1]
        reference[step + 1] = hidden.float().pow(2).mean().sqrt().item()
    mech.before_step()
    loss = engine(input_ids=batch, labels=batch).loss
    engine.backward(loss)
    engine.step()
    mech.after_step(loss)
save_checkpoint(engine, mech, "ckpt")
saved = mech.state_dict()["monitors"]["activation_norms"]
mech.close()
monitor = mech.hook.monitor("activation_norms")
print("RESULT " + json.dumps({"reference": reference, "saved": saved, "evaluations": monitor.evaluations}))
'''


def _run(tmp_path, steps: int, mode: str) -> dict:
    (tmp_path / "activation_norms.py").write_text(example("user-monitor"))
    (tmp_path / "train.py").write_text(DRIVER % {"registration": example("user-monitor-registration").strip()})
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               MASTER_PORT=str(free_port()))
    run = subprocess.run([sys.executable, "train.py", str(steps), mode], cwd=tmp_path, env=env, text=True,
                         capture_output=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-4000:]
    line = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def _records(tmp_path) -> dict:
    lines = (tmp_path / "runs" / "ds" / "mech.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines)}


def test_the_example_is_short_and_registers_with_one_call():
    assert len(example("user-monitor").strip().splitlines()) < 40
    registration = example("user-monitor-registration").strip().splitlines()
    assert [line for line in registration if "add_monitor" in line] == [registration[-1]]


@pytest.mark.timeout(700)
def test_the_doc_example_records_its_metrics_checkpoints_and_resumes(tmp_path):
    first = _run(tmp_path, 6, "fresh")
    records = _records(tmp_path)
    assert sorted(records) == [2, 4, 6]  # the evaluation steps at interval 2
    for step, record in records.items():
        assert {"act/layer0/rms", "act/layer1/rms"} <= set(record["metrics"])
        # the same layer, weights and batch as the no-grad reference forward: equal up to float32 summation
        # order between the two forwards (relative 1e-5 is ~100 ulp of float32 on an RMS of order 1)
        assert record["metrics"]["act/layer0/rms"] == pytest.approx(first["reference"][str(step)], rel=1e-5)
        assert "attn/layer0/delta2_entropy_mean" in record["metrics"]  # beside the built-in families
    assert first["saved"] == {"version": 1, "state": {"evaluations": 3}}

    resumed = _run(tmp_path, 10, "resume")
    records = _records(tmp_path)
    assert sorted(records) == [2, 4, 6, 8, 10]
    assert {"act/layer0/rms", "act/layer1/rms"} <= set(records[8]["metrics"])
    # the count of evaluations went on from the checkpoint's 3 (a fresh monitor would say 2)
    assert resumed["evaluations"] == 5 and resumed["saved"] == {"version": 1, "state": {"evaluations": 5}}
