"""DeepSpeed's own monitor (its CSV backend, real files) under ``"mech": {"output": {"writer_level": "summary"}}``:
a real one-process DeepSpeed run (CPU, gloo) of a two-layer model; what the monitor files hold is compared with the
summary recomputed from the run's full ``mech.jsonl`` (tests/unit/records/test_writer_level.py's reference)."""
from __future__ import annotations

import csv
import os
import subprocess
import sys

import pytest

from dist_utils import REPO_ROOT, free_port
from megatron_mech.records.sinks import read_jsonl
from test_writer_level import HEAD_SERIES, SUM_ORDER, expected_summary

SCRIPT = '''
import deepspeed
import torch

from megatron_mech.adapters.deepspeed.cpu import single_process_env, skip_shm_comm_build
from megatron_mech.adapters.deepspeed.engine import DeepSpeedMech
from megatron_mech.adapters.deepspeed.models import dense_llama

T, NAN_AT = 6, 3
ds_config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
             "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
             "zero_optimization": {"stage": 0},
             "csv_monitor": {"enabled": True, "output_path": "csv", "job_name": "job"},
             "mech": {"monitors": {"interval": 2}, "output": {"dir": "runs/ds", "writer_level": "summary"}}}
single_process_env()
skip_shm_comm_build()
deepspeed.init_distributed(dist_backend="gloo")
model = dense_llama(vocab_size=256, hidden=16, layers=2, heads=2, kv_heads=1, ffn=32, seq_len=17)
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
mech = DeepSpeedMech.from_engine(engine, train_steps=T)
for step in range(T):
    mech.before_step()
    batch = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(step))
    loss = engine(input_ids=batch, labels=batch).loss
    engine.backward(loss)
    engine.step()
    mech.after_step(torch.full_like(loss, float("nan")) if engine.global_steps == NAN_AT else loss)
mech.close()
'''


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_deepspeed_monitor_gets_the_summary_and_mech_jsonl_everything(tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               MASTER_PORT=str(free_port()))
    run = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, env=env, text=True, capture_output=True,
                         timeout=360)
    assert run.returncode == 0, run.stderr[-4000:]
    records = read_jsonl(tmp_path / "runs" / "ds" / "mech.jsonl")  # non-finite values decoded, as the writers got them
    # mech.jsonl keeps every head's series: 2 layers × 2 heads × 3 QK terms
    assert sum(bool(HEAD_SERIES.fullmatch(n)) for n in records[-1]["metrics"]) == 12
    expected: dict = {}
    for record in records:
        units = [a["metric"].rsplit("/", 1)[0] + "/" for a in record["alerts"]]
        for tag, value in expected_summary(record, units).items():
            expected.setdefault(tag.replace("/", "_") + ".csv", []).append((record["step"], value))
    written = {}
    for path in sorted((tmp_path / "csv" / "job").glob("mech_*.csv")):
        with open(path) as f:
            written[path.name] = [(int(step), float(value)) for step, value in list(csv.reader(f))[1:]]
    assert [s for s, _ in written["mech_alerts_symptom.csv"]] == [3]  # the NaN loss's alert, at its own step
    assert not [name for name in written if "_head0_" in name or "_head1_" in name]
    assert sorted(written) == sorted(expected)
    for name, points in expected.items():
        assert [s for s, _ in written[name]] == [s for s, _ in points], name
        assert [v for _, v in written[name]] == pytest.approx([v for _, v in points], rel=SUM_ORDER, nan_ok=True), name
