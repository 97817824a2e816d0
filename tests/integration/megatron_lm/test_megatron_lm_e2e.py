"""End to end on a real Megatron-LM fork: the core_v0.16.1 tree, patched with ``megatron-mech patch apply``, runs
its own ``pretrain_gpt.py`` under ``torchrun --nproc_per_node=2`` on CPU over gloo (the patch's first call applies
the CPU shims), training a small MoE GPT with EP=2 on the embedded corpus (``--data-path``), monitors and MoLS on.

* Legacy checkpoints (``--ckpt-format torch``), ``--overlap-grad-reduce``, the attention fault injected through
  Megatron's own ``--spec`` flag from step 16: monitor records on every step and the same values as
  TensorBoard scalars through Megatron's writer; the first alert is an attention alert in layer 1, after the
  fault starts; a resume from the step-18 checkpoint continues the monitor series (metrics, alerts, MoLS)
  exactly; every MoLS group's lr equals Megatron's scheduler formula × the class multiplier at every step.
* ``torch_dist`` checkpoints: the same exact continuation after a resume (per-rank ``ShardedObject`` state).
* ``--use-distributed-optimizer``, in both checkpoint formats: a resume continues the uninterrupted run exactly
  (monitor records, losses, MoLS) — the optimizer's step counters and moments come back as saved.
* ``--use-distributed-optimizer --overlap-param-gather --overlap-grad-reduce``: the monitors read the updated
  weights (they agree with a plain-optimizer run of the same seed) and the MoLS lrs hold there too.
* A small dense GQA GPT at ``--tensor-model-parallel-size 2``: it trains, and its losses and every monitor value
  agree with the TP=1 run of the same seed (Megatron-LM builds the same full weights before splitting them).
* The same GPT at ``--pipeline-model-parallel-size 2``: every stage hands the hook the last stage's loss, so no
  rank alerts on a loss it does not compute, and the recorded losses are Megatron-LM's own; between evaluations
  the loss goes to the hook as a tensor with no collective (one all-reduce at each evaluation and save), and a
  NaN loss of the last stage alone is judged alike, with its own step, on both stages.
* ``--mech-on-alert stop`` / ``checkpoint`` with the attention fault: Megatron-LM saves the alert step's checkpoint
  through its own save path; ``stop`` ends the run there, ``checkpoint`` trains on. Either way the end of training
  writes ``summary.json`` in the one schema, and the report reads the run's detector settings from it.
* Megatron-LM's own ``--bf16``, with and without ``--use-distributed-optimizer``: every attention entropy equals a
  single-process evaluation of the float32 main params Megatron saved (not of the bf16 weights), and a resume
  continues the series exactly; ``--mech-weights model`` reads the bf16 weights instead.

Skipped, with the reason, when the core_v0.16.1 tree is absent (see ``megatron_lm_trees``).
"""
from __future__ import annotations

import argparse
import json
import math
import re
import shutil

import pytest

from attention_reference import single_rank_metrics
from dist_utils import REPO_ROOT, run_torchrun
from optional_packages import requires
from megatron_lm_trees import CPU_TRAINING_FLAGS, RUNNABLE_TAG, SMALL_MOE_FLAGS, require, unpack
from run_summaries import assert_summary_schema

pytestmark = [pytest.mark.slow, pytest.mark.distributed, requires("tensorboard")]
GLOBAL_BATCH, WARMUP_ITERS, LR, MIN_LR = 8, 2, 1e-3, 1e-4  # as in SMALL_MOE_FLAGS
FAULT_LAUNCHER = ("-m", "megatron_mech.studies.megatron_lm_fault")  # the studies' launcher for a fork
LOSS_PROBE = REPO_ROOT / "tests" / "lm_loss_probe.py"
TIMEOUT = 420


@pytest.fixture(scope="module")
def fork(tmp_path_factory):
    require(RUNNABLE_TAG)
    from megatron_mech.adapters.megatron_lm_fork import patcher

    root = unpack(RUNNABLE_TAG, tmp_path_factory.mktemp("fork"))
    assert patcher.apply(root).state == "applied"
    return root


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from megatron_mech.trainers.data.embedded import prepare_data

    return prepare_data(tmp_path_factory.mktemp("data") / "corpus", vocab_size=1024, max_docs_per_source=40)


# A small dense GPT with grouped-query attention (4 query heads in 2 groups): 2 layers, hidden 64, 2 micro-batches per
# data-parallel rank and step at TP=1 (DP=2), 4 at TP=2 (DP=1) — the same global batch of 8.
DENSE_GQA_FLAGS = (
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--group-query-attention",
    "--num-query-groups", "2", "--ffn-hidden-size", "128", "--seq-length", "64", "--max-position-embeddings", "64",
    "--micro-batch-size", "2", "--global-batch-size", "8", "--attention-dropout", "0", "--hidden-dropout", "0",
    "--lr", "1e-3", "--min-lr", "1e-4", "--lr-warmup-iters", "2", "--lr-decay-style", "cosine", "--seed", "1234",
    "--log-interval", "1", "--eval-interval", "100000", "--eval-iters", "0",
)


def dense_gqa(tp: int) -> tuple:
    """DENSE_GQA_FLAGS at ``--tensor-model-parallel-size tp``. Megatron-LM pads the vocabulary to a multiple of
    ``make-vocab-size-divisible-by × TP``: 256 in all here, so every TP size builds the same embedding shape."""
    return (*DENSE_GQA_FLAGS, "--tensor-model-parallel-size", str(tp), "--make-vocab-size-divisible-by", str(256 // tp))


def train(fork, data, out, *extra, model=SMALL_MOE_FLAGS):
    args = [*CPU_TRAINING_FLAGS, *model, "--tokenizer-type", "NullTokenizer",
            "--vocab-size", str(data.vocab_size), "--data-path", data.train_prefix, "--split", "98,2,0",
            "--data-cache-path", str(out / "index_cache"), "--tensorboard-dir", str(out / "tb"),
            "--mech-output-dir", str(out / "mech"), *extra]
    if "--mech-fault" in extra:  # the studies' fault flags are offered by their own launcher
        return run_torchrun(*FAULT_LAUNCHER, fork / "pretrain_gpt.py", *args, nproc=2, timeout=TIMEOUT).stdout
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
FAULT = ("--spec", "megatron_mech.adapters.megatron_lm_fork.fault_spec", "layer_spec", "--mech-fault", "attention",
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


@pytest.mark.parametrize("ckpt_format", ["torch", "torch_dist"])
def test_distributed_optimizer_resumes_exactly(fork, data, tmp_path, ckpt_format):
    """Save at step 4, resume to step 8: the same records as the uninterrupted run, bit for bit (the same
    machine, seed and order of operations), with MoLS groups in the distributed optimizer."""
    steps = 8
    common = ("--train-iters", str(steps), "--mech-interval", "1", "--mech-mols", "--mech-mols-window", "2",
              "--mech-mols-min-ramp", "2", "--ckpt-format", ckpt_format, "--use-distributed-optimizer")
    run_a = tmp_path / "a"
    train(fork, data, run_a, *common, "--save", str(run_a / "ckpt"), "--save-interval", "4", model=dense_gqa(1))
    run_b = tmp_path / "b"
    train(fork, data, run_b, *common, "--load", str(resume_dir(run_a / "ckpt", 4, run_b / "ckpt")),
          model=dense_gqa(1))
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


def test_tensor_parallel_2_matches_tp1(fork, data, tmp_path):
    steps = 4
    common = ("--train-iters", str(steps), "--mech-interval", "1")
    train(fork, data, tmp_path / "tp2", *common, model=dense_gqa(2))
    train(fork, data, tmp_path / "tp1", *common, model=dense_gqa(1))
    tp2, tp1 = records(tmp_path / "tp2"), records(tmp_path / "tp1")
    assert sorted(tp2) == sorted(tp1) == list(range(1, steps + 1))
    compared = 0
    for step in range(1, steps + 1):
        # The same fp32 weights (--use-cpu-initialization draws each full matrix, then splits it) and the same
        # global batch: TP changes only the order of the sums (split matmuls, all-reduced partial results), a
        # relative error of a few float32 eps per operation; 1e-4 leaves room for its growth over the steps
        # and through the monitors' spectra (measured: 5e-7 at most).
        assert tp2[step]["loss"] == pytest.approx(tp1[step]["loss"], rel=1e-5), step
        assert set(tp2[step]["metrics"]) == set(tp1[step]["metrics"]), step
        for name, value in tp1[step]["metrics"].items():
            if value is not None:
                assert tp2[step]["metrics"][name] == pytest.approx(value, rel=1e-4, abs=1e-6), (step, name)
                compared += 1
    for layer in (0, 1):
        for head in range(4):  # per query head, across both TP shards
            assert f"attn/layer{layer}/head{head}/delta2_entropy" in tp2[steps]["metrics"]
    assert compared > 150


def probe(fork, data, out, *extra, nan_step: int = 0) -> tuple:
    """Train the PP=2 dense GPT under ``lm_loss_probe.py``: Megatron's stdout and every rank's probe record."""
    args = [*CPU_TRAINING_FLAGS, *dense_gqa(1), "--pipeline-model-parallel-size", "2", "--tokenizer-type",
            "NullTokenizer", "--vocab-size", str(data.vocab_size), "--data-path", data.train_prefix, "--split",
            "98,2,0", "--data-cache-path", str(out / "index_cache"), "--mech-output-dir", str(out / "mech"), *extra]
    env = {"MECH_PROBE_OUT": str(out / "probe"), "MECH_PROBE_NAN_STEP": str(nan_step)}
    stdout = run_torchrun(LOSS_PROBE, fork / "pretrain_gpt.py", *args, nproc=2, timeout=TIMEOUT,
                          extra_env=env).stdout
    return stdout, [json.loads((out / "probe" / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_pipeline_parallel_2_every_stage_gets_the_loss(fork, data, tmp_path):
    """PP=2: only the last stage computes the loss, yet the hook on every rank must see the same value. With
    ``--mech-on-alert stop`` a rank that saw another loss (NaN) would alert and stop alone, and the run would fail
    or end early; evaluations every 2nd step cover both paths (evaluation steps and the checks in between).
    Between evaluations the call site hands the hook the loss as a tensor and issues no collective; at an
    evaluation step one all-reduce combines every waiting step's loss over the pipeline; so does a save between
    evaluations (step 3, a legacy checkpoint per stage), whose state holds every step's loss.

    The PP=1 run is no reference here: Megatron-LM seeds each stage with ``seed + 100 × stage``, so the stages'
    layers start from other weights than at PP=1. The reference is Megatron-LM's own ``lm loss`` log line."""
    steps = 4
    out = tmp_path / "pp2"
    stdout, ranks = probe(fork, data, out, "--train-iters", str(steps), "--mech-interval", "2",
                          "--mech-on-alert", "stop", "--save", str(out / "ckpt"), "--save-interval", "3",
                          "--ckpt-format", "torch")
    recs = records(out)
    assert sorted(recs) == [2, 4]  # the evaluation steps; an alert in between would have written its step too
    assert not any(r["alerts"] for r in recs.values())
    logged = [float(v) for v in re.findall(r"lm loss: ([0-9.E+-]+)", stdout)]  # one line per iteration
    assert len(logged) == steps  # trained to the end: no rank stopped
    assert all(math.isfinite(r["loss"]) for r in recs.values())
    # Megatron logs 7 significant digits (%.6E: half a unit in the last place is 5e-7 relative), and its line for
    # iteration 2 averages iterations 1 and 2 (it does not reset its sums after the first iteration's line).
    assert (logged[0] + recs[2]["loss"]) / 2 == pytest.approx(logged[1], rel=1e-6)
    assert recs[4]["loss"] == pytest.approx(logged[3], rel=1e-6)
    for layer in (0, 1):  # each stage monitors its own layer; the records merge both
        assert f"attn/layer{layer}/delta2_entropy_mean" in recs[steps]["metrics"]
    # every step's loss, on both stages: the same values, Megatron's own (iteration 3's line holds step 3 alone)
    first, last = (rank["losses"] for rank in ranks)
    assert first == last and len(last) == steps
    assert last[0] == pytest.approx(logged[0], rel=1e-6) and last[2] == pytest.approx(logged[2], rel=1e-6)
    assert [last[1], last[3]] == [recs[2]["loss"], recs[4]["loss"]]
    for rank in ranks:  # the cost: nothing between evaluations, one combining all-reduce at each evaluation
        assert rank["loss_kinds"] == {"1": "tensor", "2": "tensor", "3": "tensor", "4": "tensor"}
        assert rank["callsite_all_reduces"] == {"2": 1, "3": 1, "4": 1}  # step 3: its save's
    import torch

    for stage in (0, 1):
        saved = torch.load(out / "ckpt" / "iter_0000003" / f"mp_rank_00_00{stage}" / "model_optim_rng.pt",
                           weights_only=False)
        assert saved["megatron_mech"]["state"]["hook"]["losses"] == last[:3]


def test_pipeline_parallel_2_nonfinite_loss_judged_alike_on_every_stage(fork, data, tmp_path):
    """PP=2, the last stage's loss NaN at step 3 (between evaluations): read back at the evaluation of step 4, it
    is judged the same on both stages — the first stage never computed it — so both stop at step 4 together; a
    stage judging alone would stop alone and the other would wait in its next collective until the timeout."""
    out = tmp_path / "pp2_nan"
    stdout, ranks = probe(fork, data, out, "--train-iters", "6", "--mech-interval", "2", "--mech-on-alert",
                          "stop", nan_step=3)
    for rank in ranks:
        assert rank["first_alert_step"] == 3 and rank["alert_steps"] == [3]
        assert rank["actions"] == {"1": "CONTINUE", "2": "CONTINUE", "3": "CONTINUE", "4": "STOP"}
        assert math.isnan(rank["losses"][2]) and all(math.isfinite(v) for i, v in enumerate(rank["losses"]) if i != 2)
    assert ranks[0]["losses"][:2] == ranks[1]["losses"][:2] and ranks[0]["losses"][3] == ranks[1]["losses"][3]
    recs = records(out)
    assert sorted(recs) == [2, 3, 4]  # step 3's alert has its own record, with its own step
    assert [a["family"] for a in recs[3]["alerts"]] and math.isnan(recs[3]["loss"])
    assert len(re.findall(r"lm loss: ", stdout)) == 4  # Megatron stopped after iteration 4


ALERT_FAULT = ("--spec", "megatron_mech.adapters.megatron_lm_fork.fault_spec", "layer_spec", "--mech-fault", "attention",
               "--mech-fault-strength", "0.1", "--mech-fault-layers", "1", "--mech-fault-start", "12")
ALERT_DETECT = ("--mech-interval", "1", "--mech-detector-warmup", "2", "--mech-detector-baseline", "6")


def first_alert_step(recs: dict) -> int:
    alerted = sorted(s for s, r in recs.items() if r["alerts"])
    assert alerted and alerted[0] >= 12, alerted  # not before the fault starts
    assert {al["family"] for al in recs[alerted[0]]["alerts"]} == {"attention"}
    return alerted[0]


def assert_megatron_checkpoint(ckpt, step: int) -> None:
    """``ckpt/iter_<step>`` is Megatron-LM's own legacy checkpoint of the finished iteration ``step``: its
    iteration counter and its scheduler (stepped after the update, GLOBAL_BATCH samples a step) say so."""
    import torch

    saved = torch.load(ckpt / f"iter_{step:07d}" / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)
    assert saved["iteration"] == step
    assert saved["opt_param_scheduler"]["num_steps"] == step * GLOBAL_BATCH
    assert "megatron_mech" in saved


@pytest.mark.parametrize("on_alert", ["stop", "checkpoint"])
def test_on_alert_saves_through_megatron(fork, data, tmp_path, on_alert):
    steps, save_interval = 40, 8
    out = tmp_path / on_alert
    ckpt = out / "ckpt"
    stdout = train(fork, data, out, "--train-iters", str(steps), *ALERT_DETECT, *ALERT_FAULT,
                   "--mech-on-alert", on_alert, "--save", str(ckpt), "--save-interval", str(save_interval),
                   "--ckpt-format", "torch", model=dense_gqa(1))
    recs = records(out)
    alert = first_alert_step(recs)
    # the alert's checkpoint is not a regular one, and a stop leaves steps untrained (22 with this seed)
    assert alert % save_interval != 0 and alert < steps, alert
    assert_megatron_checkpoint(ckpt, alert)
    before = max(s for s in range(save_interval, alert, save_interval))
    assert json.loads((ckpt / "first_alert.json").read_text()) == {
        "step": alert, "checkpoint": str(ckpt / f"iter_{alert:07d}"), "last_checkpoint_before_alert": before}
    saved = sorted(int(p.name[len("iter_"):]) for p in ckpt.glob("iter_*"))
    if on_alert == "stop":
        assert sorted(recs) == list(range(1, alert + 1))  # no step after the alert's
        assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(alert)
        assert saved == [*range(save_interval, alert, save_interval), alert]
        assert f"stopping at iteration {alert} on the first alert" in stdout
    else:
        assert sorted(recs) == list(range(1, steps + 1))  # trained on to the end
        assert saved == sorted({*range(save_interval, steps + 1, save_interval), alert, steps})
    assert_fork_summary(out / "mech", recs, final_step=alert if on_alert == "stop" else steps, train_iters=steps)


def assert_fork_summary(mech_dir, recs: dict, *, final_step: int, train_iters: int) -> None:
    """The fork's end of training (``train`` returning, or ending the process on a stop) wrote ``summary.json``
    beside ``mech.jsonl``, in the schema the other trainers write: its alerts are the records' (as dicts, in order),
    its losses each step's recorded loss, its arming the run's ``--mech-detector-*`` settings. The report reads
    it: its detector settings and armed-from step come from that summary, not from the default rules."""
    from megatron_mech.monitors.registry import default_registry
    from megatron_mech.records.report import run_report
    from megatron_mech.records.report_guides import run_settings

    raw, summary = assert_summary_schema(mech_dir / "summary.json", trainer_keys={"train_iters"})
    assert summary.trainer == {"train_iters": train_iters} and summary.step_seconds is None
    assert summary.final_step == final_step == max(recs) and summary.first_step == 1
    assert raw["alerts"] == [alert for step in sorted(recs) for alert in recs[step]["alerts"]]
    assert summary.diagnosis["step"] == first_alert_step(recs)
    assert summary.losses == pytest.approx([recs[step]["loss"] for step in sorted(recs)], rel=1e-6)
    assert summary.detectors["rule_overrides"] == {"warmup": 2, "baseline": 6}

    settings = run_settings(mech_dir / "mech.jsonl")
    assert settings.source == "summary.json" and settings.armed_from_step == summary.detectors["armed_from_step"]
    # the rules rebuilt from the summary's settings: warm-up 2 + baseline 6 + persistence 3 evaluations, not 51
    assert settings.registry.earliest_alert()[1] == 11 < default_registry().earliest_alert()[1]
    assert run_report(argparse.Namespace(run_dir=str(mech_dir), out=None, metrics=None)) == 0


# bf16: Megatron-LM's own --bf16 (bf16 weights, float32 main params) at a learning rate where a 2-step Adam update
# (at most 2 × 3e-5) is about one bf16 rounding step of the weights (2^-14 ≈ 6e-5 for |w| in [2^-7, 2^-6); the
# weights start at N(0, 0.02)), so the bf16 copies' ΔW is mostly rounding and reading them instead of the master
# weights changes the monitors' values. Checkpoints every evaluation, so each evaluated weight is saved.
BF16 = ("--bf16", "--lr", "3e-5", "--min-lr", "3e-6", "--mech-interval", "2", "--ckpt-format", "torch",
        "--save-interval", "2")
GQA_SHAPE = dict(num_heads=4, num_query_groups=2, head_dim=16, interval=2)   # DENSE_GQA_FLAGS' attention
# The reference evaluates the same float32 ΔW as the run (both difference the same float32 weights) in one process;
# the run may split the heads' work over the data-parallel replicas and sum in another order. Only float32
# summation order can differ, which moves an entropy in [0, 1] by ~1e-7 (measured here: 0); 1e-5 leaves margin
# and is far below what reading the other weights changes (asserted: > 100x it; measured 0.37).
EXACT_TOL = 1e-5


def saved_qkv_weights(ckpt, step: int, layer: int) -> tuple:
    """``(float32 master, bf16 model weight)`` of ``layer``'s QKV weight in Megatron-LM's legacy checkpoint of
    ``step``, from Megatron's own saved main params: ``Float16OptimizerWithFloat16Params``' ``fp32_from_fp16_params``,
    or the ``DistributedOptimizer``'s flat ``param`` buffer (``distrib_optim.pt``, gathered over data-parallel
    ranks). Neither names its tensors: the master is the one (asserted: exactly one) that rounds to the bf16 weight."""
    import torch

    folder = ckpt / f"iter_{step:07d}" / "mp_rank_00"
    saved = torch.load(folder / "model_optim_rng.pt", weights_only=False)
    model = saved["model"][f"decoder.layers.{layer}.self_attention.linear_qkv.weight"]
    assert model.dtype == torch.bfloat16
    if (folder / "distrib_optim.pt").is_file():
        (buffer,) = torch.load(folder / "distrib_optim.pt", weights_only=False)[0].values()
        flat, wanted, n = buffer["param"], model.flatten(), model.numel()
        rounded = flat.to(torch.bfloat16)
        starts = torch.nonzero(rounded[:flat.numel() - n + 1] == wanted[0]).flatten().tolist()
        found = [flat[s:s + n].view_as(model) for s in starts if torch.equal(rounded[s:s + n], wanted)]
    else:
        found = [t for group in saved["optimizer"]["fp32_from_fp16_params"] for t in group
                 if t.shape == model.shape and torch.equal(t.to(torch.bfloat16), model)]
    assert len(found) == 1, (step, layer, len(found))
    assert found[0].dtype == torch.float32
    # training has moved the main params off the bf16 grid: the two readings differ
    assert not torch.equal(found[0], model.float()), (step, layer)
    return found[0], model.float()


def assert_bf16_readings(recs: dict, ckpt, read: str) -> None:
    """Every attention entropy the run recorded equals a single-process evaluation of the ``read`` weights
    (``master`` or ``model``) of the checkpoints ``ckpt`` holds at the recorded steps, and not of the others."""
    worst, other_gap, compared = 0.0, 0.0, 0
    for layer in (0, 1):
        saved = {step: saved_qkv_weights(ckpt, step, layer) for step in sorted(recs)}
        readings = {kind: single_rank_metrics({step: weights[i] for step, weights in saved.items()}, sorted(saved),
                                              layer, **GQA_SHAPE) for i, kind in enumerate(("master", "model"))}
        want, other = readings[read], readings["model" if read == "master" else "master"]
        assert sorted(want) == sorted(recs)[1:]   # the first recorded step is the reference's starting snapshot
        for step in want:
            names = [k for k in want[step] if k.startswith(f"attn/layer{layer}/") and "entropy" in k]
            assert len(names) >= 3 * GQA_SHAPE["num_heads"]
            for name in names:
                assert math.isfinite(recs[step]["metrics"][name]), (step, name)
                worst = max(worst, abs(recs[step]["metrics"][name] - want[step][name]))
                other_gap = max(other_gap, abs(other[step][name] - want[step][name]))
                compared += 1
    assert compared >= 2 * 3 * GQA_SHAPE["num_heads"]
    assert worst <= EXACT_TOL, worst
    assert other_gap > 100 * EXACT_TOL, other_gap   # reading the other weights would have recorded other values


@pytest.mark.parametrize("optimizer", [(), ("--use-distributed-optimizer",)], ids=["float16-optimizer", "distributed"])
def test_bf16_fork_monitors_read_the_master_weights_and_resume_exactly(fork, data, tmp_path, optimizer):
    """Megatron-LM's ``--bf16`` on CPU (torch's bf16 kernels) with and without ``--use-distributed-optimizer``:
    records with monitor metrics, the start line naming the float32 master weights, every attention entropy equal
    to a single-process evaluation of the main params Megatron saved in its checkpoints (and not to one of the
    bf16 weights), and a resume from the step-4 checkpoint continuing the monitor series exactly."""
    steps = 8
    common = ("--train-iters", str(steps), *BF16, *optimizer)
    run_a = tmp_path / "a"
    stdout = train(fork, data, run_a, *common, "--save", str(run_a / "ckpt"), model=dense_gqa(1))
    assert "reading the optimizer's float32 master weights" in stdout
    a = records(run_a)
    assert sorted(a) == [2, 4, 6, 8]
    assert all(math.isfinite(r["loss"]) for r in a.values())
    assert_bf16_readings(a, run_a / "ckpt", "master")

    run_b = tmp_path / "b"
    train(fork, data, run_b, *common, "--load", str(resume_dir(run_a / "ckpt", 4, run_b / "ckpt")),
          model=dense_gqa(1))
    b = records(run_b)
    assert sorted(b) == [6, 8]
    assert_same_series(a, b, (6, 8))


def test_bf16_fork_reads_the_bf16_weights_when_asked(fork, data, tmp_path):
    """``--mech-weights model``: the start line says so, and the monitors read the bf16 weights, not the masters."""
    out = tmp_path / "model"
    stdout = train(fork, data, out, "--train-iters", "4", *BF16, "--mech-weights", "model", "--save",
                   str(out / "ckpt"), model=dense_gqa(1))
    assert "reading the model's bfloat16 weights" in stdout
    recs = records(out)
    assert sorted(recs) == [2, 4]
    assert_bf16_readings(recs, out / "ckpt", "model")
