"""bf16 training with the DeepSpeed launcher (``--bf16``: ``"bf16": {"enabled": true}``) at ZeRO 0–3 on CPU: the
monitors read DeepSpeed's float32 master weights, which equal a single-process computation from the float32
weights DeepSpeed's own ``zero_to_fp32`` rebuilds from the checkpoint; records, checkpoints and resume work."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from dist_utils import REPO_ROOT, run_torchrun
from megatron_mech.core.spectral import qk_increment_spectra, spectral_entropy
from optional_packages import requires

pytestmark = [requires("deepspeed", "transformers"), pytest.mark.slow, pytest.mark.distributed,
              pytest.mark.timeout(600)]

LAUNCHER = ("-m", "megatron_mech.trainers.deepspeed.train")  # torchrun -m
HEADS, KV_HEADS, HIDDEN = 4, 2, 64
# a small learning rate (warm-up from 0 to 3e-5), where a 5-step update is a few bf16 rounding steps of the weights
FLAGS = ["--bf16", "--mech-interval", "5", "--lr", "3e-5", "--hidden", str(HIDDEN), "--heads", str(HEADS),
         "--kv-heads", str(KV_HEADS)]
# The reference computes each head's Δ2 spectrum by the QR route from the same float32 weights in one process; the
# run uses the Gram route (singular values from eigenvalues of a float32 Gram, reduced in float64). The two
# differ by float32 rounding, which moves an entropy in [0, 1] by ~1e-7 (measured here: 9e-8 at ZeRO-2 and -3);
# 1e-5 leaves a 100x margin and is far below what the bf16 copies change (asserted: > 100x it; measured 0.16).
EXACT_TOL = 1e-5


def launch(run_dir: Path, stage: int, steps: int, *extra: str) -> dict:
    out = run_torchrun(*LAUNCHER, *FLAGS, "--zero-stage", str(stage), "--steps", str(steps), "--output-dir",
                       str(run_dir), "--save", str(run_dir / "ckpt"), *extra, timeout=420).stdout
    records = [json.loads(line) for line in (run_dir / "mech.jsonl").read_text().splitlines()]
    return {"stdout": out, "records": records}


def initial_weights() -> dict:
    """The launcher's model at its seed, as DeepSpeed starts it in bf16 (its master weights: the bf16 values)."""
    from megatron_mech.trainers.deepspeed import train as deepspeed_train

    args = deepspeed_train.parse_args(FLAGS)
    return {k: v.to(torch.bfloat16).float() for k, v in deepspeed_train.build_model(args).state_dict().items()}


def checkpoint_weights(ckpt: Path, step: int) -> dict:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return {k: v.float() for k, v in get_fp32_state_dict_from_zero_checkpoint(str(ckpt),
                                                                              tag=f"global_step{step}").items()}


def delta2_entropies(before: dict, after: dict, layer: int) -> list:
    """Each head's normalised Δ2 spectral entropy of ``layer`` between two float32 state dicts."""
    d_head = HIDDEN // HEADS

    def qk(weights):
        prefix = f"model.layers.{layer}.self_attn."
        wq = weights[prefix + "q_proj.weight"].double().reshape(HEADS, d_head, HIDDEN).transpose(1, 2)
        wk = weights[prefix + "k_proj.weight"].double().reshape(KV_HEADS, d_head, HIDDEN).transpose(1, 2)
        return wq, wk

    spectra = qk_increment_spectra(*qk(before), *qk(after), terms=("delta2",))
    return spectral_entropy(spectra.delta2).tolist()


@pytest.mark.parametrize("stage", [2, 3])
def test_master_weights_under_zero_equal_a_single_process_reference_across_a_resume(tmp_path, stage):
    run_dir = tmp_path / "run"
    first = launch(run_dir, stage, 5)
    assert "reading the optimizer's float32 master weights" in first["stdout"]
    resumed = launch(run_dir, stage, 10, "--load", str(run_dir / "ckpt"))
    records = {r["step"]: r["metrics"] for r in resumed["records"]}
    assert sorted(records) == [5, 10]
    weights = {0: initial_weights(), 5: checkpoint_weights(run_dir / "ckpt", 5),
               10: checkpoint_weights(run_dir / "ckpt", 10)}
    rounded = {step: {k: v.to(torch.bfloat16).float() for k, v in w.items()} for step, w in weights.items()}
    worst, bf16_gap = 0.0, 0.0
    for before, after in ((0, 5), (5, 10)):
        for layer in (0, 1):
            want = delta2_entropies(weights[before], weights[after], layer)
            from_bf16 = delta2_entropies(rounded[before], rounded[after], layer)
            for head in range(HEADS):
                got = records[after][f"attn/layer{layer}/head{head}/delta2_entropy"]
                assert math.isfinite(got)
                worst = max(worst, abs(got - want[head]))
                bf16_gap = max(bf16_gap, abs(from_bf16[head] - want[head]))
    assert worst <= EXACT_TOL, (worst, bf16_gap)
    assert bf16_gap > 100 * EXACT_TOL, (worst, bf16_gap)


@pytest.mark.parametrize("stage,extra", [(0, []), (1, ["--mols"])], ids=["zero0", "zero1-mols"])
def test_bf16_trains_records_checkpoints_and_resumes(tmp_path, stage, extra):
    run_dir = tmp_path / "run"
    first = launch(run_dir, stage, 5, *extra)
    assert "reading the optimizer's float32 master weights" in first["stdout"]
    resumed = launch(run_dir, stage, 10, "--load", str(run_dir / "ckpt"), *extra)
    if extra:   # MoLS measured its window (steps 1-5) and scales the groups after the resume
        assert any(v != 1.0 for k, v in resumed["records"][-1]["mols"].items() if k.startswith("mols/mult/"))
    assert [r["step"] for r in resumed["records"]] == [5, 10]
    for record in resumed["records"]:
        assert math.isfinite(record["loss"])
        assert all(math.isfinite(record["metrics"][f"attn/layer{i}/delta2_entropy_mean"]) for i in (0, 1))
    assert (run_dir / "ckpt" / "global_step10").is_dir()


def test_model_weights_are_read_when_asked(tmp_path):
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
              "zero_optimization": {"stage": 2}, "steps_per_print": 10 ** 9,
              "mech": {"monitors": {"interval": 5, "weights": "model"}, "output": {"dir": str(tmp_path / "run")}}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    out = run_torchrun(*LAUNCHER, *FLAGS, "--deepspeed-config", str(path), "--steps", "5", "--output-dir",
                       str(tmp_path / "run"), timeout=420).stdout
    assert "reading the model's bfloat16 weights" in out
