"""The per-layer maximum attention logit and its level rule on the DeepSpeed path: a real one-process DeepSpeed
engine (CPU, gloo) training a tiny HF Llama. Each recorded layer maximum equals the one the attention kernel itself
received on that step (the model's ``eager_attention_forward`` wrapped to take the max of its own ``query·keyᵀ ×
scaling`` over the causal positions: an independent reference, read inside the kernel, while the adapter reads
the projections and the rotary embedding around it); a run at LR 30 is alerted at the first evaluation, diagnosed
as a learning-rate problem, the line naming the metric and the level."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dist_utils import REPO_ROOT, free_port
from optional_packages import requires
from megatron_mech.records.sinks import read_jsonl

pytestmark = [requires("deepspeed", "transformers"), pytest.mark.slow, pytest.mark.timeout(400)]

SCRIPT = '''
import json
import sys

import deepspeed
import torch
import transformers.models.llama.modeling_llama as llama

from megatron_mech.adapters.deepspeed.cpu import single_process_env, skip_shm_comm_build
from megatron_mech.adapters.deepspeed.engine import DeepSpeedMech
from megatron_mech.adapters.deepspeed.models import dense_llama

LR, T = float(sys.argv[1]), 6
kernel_maxima = {}  # step -> {layer: max logit} as the attention kernel received them
current = {"step": 0}
original = llama.eager_attention_forward


def reference_attention(module, query, key, value, attention_mask, scaling, **kwargs):
    with torch.no_grad():
        groups = query.shape[1] // key.shape[1]
        logits = query.double() @ key.double().repeat_interleave(groups, dim=1).transpose(-1, -2) * scaling
        s = logits.shape[-1]
        causal = torch.ones(s, s, dtype=torch.bool).tril()
        top = float(logits.masked_fill(~causal, float("-inf")).max())
        held = kernel_maxima.setdefault(current["step"], {})
        held[module.layer_idx] = max(held.get(module.layer_idx, float("-inf")), top)
    return original(module, query, key, value, attention_mask, scaling, **kwargs)


llama.eager_attention_forward = reference_attention
ds_config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
             "optimizer": {"type": "AdamW", "params": {"lr": LR, "torch_adam": True}},
             "zero_optimization": {"stage": 0},
             "mech": {"monitors": {"interval": 2}, "output": {"dir": "run"}}}
single_process_env()
skip_shm_comm_build()
deepspeed.init_distributed(dist_backend="gloo")
model = dense_llama(vocab_size=256, hidden=32, layers=2, heads=4, kv_heads=2, ffn=64, seq_len=17)
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
mech = DeepSpeedMech.from_engine(engine, train_steps=T)
losses = []
for step in range(1, T + 1):
    current["step"] = step
    mech.before_step()
    batch = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(step))
    loss = engine(input_ids=batch, labels=batch).loss
    engine.backward(loss)
    engine.step()
    losses.append(float(loss))
    mech.after_step(loss)
mech.close()
print("@@RESULT " + json.dumps({"kernel_maxima": kernel_maxima, "losses": losses}))
'''


def run(tmp_path, lr: str) -> tuple:
    (tmp_path / "train.py").write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               MASTER_PORT=str(free_port()))
    out = subprocess.run([sys.executable, "train.py", lr], cwd=tmp_path, env=env, text=True, capture_output=True,
                         timeout=360)
    assert out.returncode == 0, out.stderr[-4000:]
    [line] = [x for x in out.stdout.splitlines() if x.startswith("@@RESULT ")]
    return json.loads(line[len("@@RESULT "):]), read_jsonl(tmp_path / "run" / "mech.jsonl"), out.stderr


def test_each_layers_maximum_equals_the_kernels_and_a_normal_run_stays_below_the_level(tmp_path):
    result, records, _ = run(tmp_path, "1e-3")
    assert [r["step"] for r in records] == [2, 4, 6]
    for record in records:
        kernel = result["kernel_maxima"][str(record["step"])]
        for layer in (0, 1):
            got = record["metrics"][f"symptom/max_attn_logit/layer{layer}"]
            # float32 q·k in the recorder vs float64 of the kernel's float32 inputs: a few 1e-7 relative
            assert got == pytest.approx(kernel[str(layer)], rel=1e-5)
            assert 0 < got < 100
        assert record["alerts"] == []


def test_lr_30_is_alerted_at_the_first_evaluation_as_a_learning_rate_problem(tmp_path):
    result, records, stderr = run(tmp_path, "30")
    assert max(result["losses"]) > 10 * result["losses"][0]  # the run blew up
    alerts = [a for r in records for a in r["alerts"]]
    first_step = min(a["step"] for a in alerts)
    assert first_step == 2  # the first evaluation
    first = [a for a in alerts if a["step"] == first_step]
    assert {a["metric"] for a in first} == {"symptom/max_attn_logit/layer0", "symptom/max_attn_logit/layer1"}
    assert {a["detail"]["cause"] for a in first} == {"learning_rate"}
    lines = [x for x in stderr.splitlines() if "[mech] ALERT step 2:" in x]
    assert lines and all("learning-rate / global-scale problem suspected" in x for x in lines), lines
    assert all("max attention logit" in x and "above level 100" in x for x in lines), lines
