"""End to end on a real Megatron-LM fork: the core_v0.16.1 tree, patched with ``megatron-mech patch apply``, runs
its own ``pretrain_gpt.py`` under ``torchrun --nproc_per_node=2`` on CPU over gloo (the patch's first call applies
the CPU shims), training a small MoE GPT with EP=2 on the embedded corpus (``--data-path``), monitors and MoLS on.

* Legacy checkpoints (``--ckpt-format torch``), ``--overlap-grad-reduce``, the attention fault injected through
  Megatron's own ``--spec`` flag from step 16: monitor records on every step and the same values as
  TensorBoard scalars through Megatron's writer; the first alert is an attention alert in layer 1, after the
  fault starts; a resume from the step-18 checkpoint continues the monitor series (metrics, alerts, MoLS)
  exactly; every MoLS group's lr equals Megatron's scheduler formula × the class multiplier at every step.
* ``torch_dist`` checkpoints: the same exact continuation after a resume (per-rank ``ShardedObject`` state).
* ``--use-distributed-optimizer --overlap-param-gather --overlap-grad-reduce``: the monitors read the updated
  weights (they agree with a plain-optimizer run of the same seed) and the MoLS lrs hold there too.

Skipped, with the reason, when the core_v0.16.1 tree is absent (see ``megatron_lm_trees``).
"""
from __future__ import annotations

import json
import math
import shutil

import pytest

from dist_utils import run_torchrun
from megatron_lm_trees import CPU_TRAINING_FLAGS, RUNNABLE_TAG, SMALL_MOE_FLAGS, require, unpack

pytest.importorskip("tensorboard")
GLOBAL_BATCH, WARMUP_ITERS, LR, MIN_LR = 8, 2, 1e-3, 1e-4  # as in SMALL_MOE_FLAGS
TIMEOUT = 420


@pytest.fixture(scope="module")
def fork(tmp_path_factory):
    require(RUNNABLE_TAG)
    from megatron_mech.megatron_lm import patcher

    root = unpack(RUNNABLE_TAG, tmp_path_factory.mktemp("fork"))
    assert patcher.apply(root).state == "applied"
    return root


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from megatron_mech.megatron.data import prepare_data

    return prepare_data(tmp_path_factory.mktemp("data") / "corpus", vocab_size=1024, max_docs_per_source=40)


def train(fork, data, out, *extra):
    args = [*CPU_TRAINING_FLAGS, *SMALL_MOE_FLAGS, "--tokenizer-type", "NullTokenizer",
            "--vocab-size", str(data.vocab_size), "--data-path", data.train_prefix, "--split", "98,2,0",
            "--data-cache-path", str(out / "index_cache"), "--tensorboard-dir", str(out / "tb"),
            "--mech-output-dir", str(out / "mech"), *extra]
    return run_torchrun(fork / "pretrain_gpt.py", *args, nproc=2, timeout=TIMEOUT).stdout


def records(out) -> dict:
    from megatron_mech.records.sinks import read_jsonl

    return {r["step"]: r for r in read_jsonl(out / "mech" / "mech.jsonl")}


def resume_dir(src_ckpt, step, dest):
    """A checkpoint directory holding only ``iter_<step>`` of ``src_ckpt`` (Megatron loads the tracked one)."""
    dest.mkdir(parents=True)
    name = f"iter_{step:07d}"
    shutil.copytree(src_ckpt / name, dest / name)
    (dest / "latest_checkpointed_iteration.txt").write_text(str(step))
    return dest


def scheduler_lr(step: int, train_iters: int) -> float:
    """Megatron's OptimizerParamScheduler lr for optimizer step ``step`` (1-based): linear warm-up from 0 over
    WARMUP_ITERS steps, then cosine decay to MIN_LR at ``train_iters``; counted in samples, stepped after each
    update, so step ``s`` runs at the value for ``(s - 1) × global batch`` samples."""
    num, warmup, decay = (step - 1) * GLOBAL_BATCH, WARMUP_ITERS * GLOBAL_BATCH, train_iters * GLOBAL_BATCH
    if num <= warmup:
        return LR * num / warmup
    ratio = (num - warmup) / (decay - warmup)
    return MIN_LR + 0.5 * (math.cos(math.pi * ratio) + 1.0) * (LR - MIN_LR)


def assert_mols_lrs(recs: dict, train_iters: int) -> None:
    """Every MoLS group's lr = scheduler lr × its class multiplier, at every recorded step; not all 1."""
    scaled = False
    for step, r in recs.items():
        base = scheduler_lr(step, train_iters)
        for cls, lrs in r["mols_group_lr"].items():
            mult = r["mols"][f"mols/mult/{cls}"]
            scaled |= abs(mult - 1.0) > 1e-3
            assert lrs == pytest.approx([base * mult], rel=1e-9, abs=1e-15), (step, cls, lrs, base, mult)
    assert scaled, "no MoLS multiplier ever differed from 1: the check above would not catch a missing scale"


def assert_same_series(a: dict, b: dict, steps) -> None:
    for step in steps:
        ra, rb = a[step], b[step]
        assert rb["metrics"] == ra["metrics"], f"step {step}: monitor metrics differ after the resume"
        for key in ("loss", "alerts", "mols", "mols_group_lr"):
            assert rb.get(key) == ra.get(key), f"step {step}: {key} differs after the resume"


MOLS = ("--mech-mols", "--mech-mols-window", "4", "--mech-mols-min-ramp", "4")
FAULT = ("--spec", "megatron_mech.megatron_lm.fault_spec", "layer_spec", "--mech-fault", "attention",
         "--mech-fault-strength", "0.1", "--mech-fault-layers", "1", "--mech-fault-start", "16")
DETECT = ("--mech-interval", "1", "--mech-detector-warmup", "4", "--mech-detector-baseline", "8")


def test_patched_fork_trains_monitors_alerts_resumes_legacy(fork, data, tmp_path):
    steps = 36
    common = ("--train-iters", str(steps), *DETECT, *MOLS, *FAULT, "--ckpt-format", "torch", "--overlap-grad-reduce")
    run_a = tmp_path / "a"
    stdout = train(fork, data, run_a, *common, "--save", str(run_a / "ckpt"), "--save-interval", "18")
    a = records(run_a)
    assert sorted(a) == list(range(1, steps + 1))
    for step in range(2, steps + 1):
        for layer in (0, 1):
            assert f"attn/layer{layer}/delta2_entropy_mean" in a[step]["metrics"], step
            assert f"router/layer{layer}/entropy_mean" in a[step]["metrics"], step

    # the same values through Megatron's TensorBoard writer (rank world_size - 1)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_a / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    tag = "mech/attn/layer1/delta2_entropy_mean"
    scalars = {e.step: e.value for e in events.Scalars(tag)}
    expected = {s: r["metrics"]["attn/layer1/delta2_entropy_mean"] for s, r in a.items()
                if r["metrics"].get("attn/layer1/delta2_entropy_mean") is not None}
    assert expected and set(scalars) == set(expected)
    for s, v in expected.items():
        assert scalars[s] == pytest.approx(v, rel=1e-6, nan_ok=True)  # TensorBoard stores float32
    assert "learning-rate" in events.Tags()["scalars"]  # Megatron's own scalars, same writer

    # the injected attention fault raises the attention alert, in the faulty layer, not before it starts
    alerted = sorted(s for s, r in a.items() if r["alerts"])
    assert alerted and alerted[0] >= 16, alerted
    first = a[alerted[0]]["alerts"]
    assert {al["family"] for al in first} == {"attention"} and 1 in {al["detail"]["layer"] for al in first}
    assert "attention-precision fault suspected in layer 1" in stdout

    assert_mols_lrs(a, steps)

    # resume from the step-18 checkpoint: the monitor series continues exactly
    run_b = tmp_path / "b"
    train(fork, data, run_b, *common, "--load", str(resume_dir(run_a / "ckpt", 18, run_b / "ckpt")))
    b = records(run_b)
    assert sorted(b) == list(range(19, steps + 1))
    assert_same_series(a, b, range(19, steps + 1))


def test_patched_fork_resumes_torch_dist(fork, data, tmp_path):
    steps = 8
    common = ("--train-iters", str(steps), "--mech-interval", "1", "--mech-mols", "--mech-mols-window", "2",
              "--mech-mols-min-ramp", "2", "--ckpt-format", "torch_dist")
    run_a = tmp_path / "a"
    train(fork, data, run_a, *common, "--save", str(run_a / "ckpt"), "--save-interval", "4")
    run_b = tmp_path / "b"
    train(fork, data, run_b, *common, "--load", str(resume_dir(run_a / "ckpt", 4, run_b / "ckpt")))
    a, b = records(run_a), records(run_b)
    assert sorted(b) == list(range(5, steps + 1))
    assert_same_series(a, b, range(5, steps + 1))
    assert_mols_lrs(b, steps)


def test_overlap_param_gather_monitors_read_updated_weights(fork, data, tmp_path):
    steps = 8
    common = ("--train-iters", str(steps), "--mech-interval", "1", "--mech-mols", "--mech-mols-window", "2",
              "--mech-mols-min-ramp", "2")
    train(fork, data, tmp_path / "overlap", *common, "--use-distributed-optimizer", "--overlap-param-gather",
          "--overlap-grad-reduce")
    train(fork, data, tmp_path / "plain", *common)
    overlap, plain = records(tmp_path / "overlap"), records(tmp_path / "plain")
    assert sorted(overlap) == sorted(plain) == list(range(1, steps + 1))
    compared = 0
    for step in range(2, steps + 1):
        for name, value in plain[step]["metrics"].items():
            if name.startswith("attn/") and value is not None:
                # distributed vs plain optimizer: same math, different summation order
                assert overlap[step]["metrics"][name] == pytest.approx(value, rel=1e-4, abs=1e-6), (step, name)
                compared += 1
    assert compared > 50
    assert_mols_lrs(overlap, steps)
