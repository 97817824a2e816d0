"""Single-GPU smoke test (marker ``gpu``): a few steps of the patched Megatron-LM fork (core_v0.16.1) on one GPU in
bf16 with the monitors on, using Transformer Engine (``--transformer-impl transformer_engine``), flash-attn
(``--attention-backend flash``) and apex (fused Adam, picked up by megatron-core) when they are installed.

Asserts: nothing of the CPU shims is applied (CUDA is there), the monitor records appear on every evaluation
step with finite attention entropies, router metrics are there (MoE), and a clean run raises no alert. Skipped,
with the reason, without CUDA or without the fork. Run it with ``pytest -m gpu tests/integration/megatron_lm/test_gpu_smoke.py``.
"""
from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from dist_utils import run_torchrun
from megatron_lm_trees import RUNNABLE_TAG, require, unpack

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="no CUDA device: the single-GPU smoke test needs one GPU")]

STEPS, INTERVAL = 30, 5


def _installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


@pytest.mark.slow
@pytest.mark.distributed
def test_patched_fork_bf16_one_gpu(tmp_path):
    require(RUNNABLE_TAG)
    from megatron_mech.trainers.data.embedded import prepare_data
    from megatron_mech.adapters.megatron_lm_fork import patcher
    from megatron_mech.records.sinks import read_jsonl

    fork = unpack(RUNNABLE_TAG, tmp_path)
    assert patcher.apply(fork).state == "applied"
    data = prepare_data(tmp_path / "corpus", vocab_size=1024, max_docs_per_source=40)
    te = _installed("transformer_engine")
    flags = ["--transformer-impl", "transformer_engine" if te else "local"]
    if _installed("flash_attn"):
        flags += ["--attention-backend", "flash"]
    out = tmp_path / "run"
    stdout = run_torchrun(
        fork / "pretrain_gpt.py", *flags, "--bf16", "--distributed-backend", "nccl",
        "--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8", "--num-query-groups", "4",
        "--ffn-hidden-size", "1024", "--num-experts", "4", "--moe-router-topk", "2", "--disable-bias-linear",
        "--seq-length", "256", "--max-position-embeddings", "256", "--micro-batch-size", "8",
        "--global-batch-size", "32", "--train-iters", str(STEPS), "--lr", "1e-3", "--min-lr", "1e-4",
        "--lr-warmup-iters", "5", "--log-interval", "5", "--eval-interval", "100000", "--eval-iters", "0",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", str(data.vocab_size), "--data-path",
        data.train_prefix, "--split", "98,2,0", "--data-cache-path", str(out / "index_cache"),
        "--mech-interval", str(INTERVAL), "--mech-output-dir", str(out), "--tensorboard-dir", str(out / "tb"),
        nproc=1, timeout=900, extra_env={"CUDA_VISIBLE_DEVICES": "0"}).stdout
    assert "megatron-mech: applied current_device" not in stdout  # no CPU shim on a GPU machine
    records = {r["step"]: r for r in read_jsonl(out / "mech.jsonl")}
    assert sorted(records) == list(range(INTERVAL, STEPS + 1, INTERVAL))
    for step, r in records.items():
        for layer in range(4):
            value = r["metrics"][f"attn/layer{layer}/delta2_entropy_mean"]
            assert value is not None and math.isfinite(value) and 0.0 < value <= 1.0, (step, layer, value)
            assert f"router/layer{layer}/entropy_mean" in r["metrics"]
        assert r["alerts"] == [], (step, r["alerts"])
