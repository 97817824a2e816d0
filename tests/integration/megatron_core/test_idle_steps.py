"""Between evaluation steps the monitors cost nothing: no tensor op, no host sync, no collective (torchrun + gloo).

A real megatron-core MoE GPT (2 ranks, EP=2) trains 6 steps with every monitor that touches the forward pass or
the step: attention, router capture, the max-attention-logit capture, the expert monitor and MoLS (window of 2
steps), evaluating every 3 steps. A ``TorchDispatchMode`` (tests/workers/op_attribution.py) attributes each
torch op to the code that issued it. The reference is the evaluation grid itself: steps 3 and 6 evaluate, so the
monitors' ops (the captures' and the evaluation's, with their all-reduces) must show there; steps 1 and 2 are
MoLS's estimation window, where its gradient statistics must show; steps 4 and 5 are neither, and there the
monitoring code must issue no op at all. The same holds for a real DeepSpeed engine, the adapter's own code
included (it hands the hook the loss and DeepSpeed's grad norm as they are between evaluations).
"""
import json
import math

import pytest

from dist_utils import REPO_ROOT, run_torchrun

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

WORKER = REPO_ROOT / "tests" / "workers" / "idle_step_ops_worker.py"
DEEPSPEED_WORKER = REPO_ROOT / "tests" / "workers" / "deepspeed_idle_ops_worker.py"
TINY_MOE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "128",
            "--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "2",
            "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "2e-3",
            "--lr-warmup-iters", "2", "--eval-iters", "1", "--train-iters", "6"]


def test_monitors_issue_no_op_between_evaluation_steps(tmp_path):
    out_file = tmp_path / "ops.json"
    run_torchrun(WORKER, str(out_file), *TINY_MOE, "--mech-interval", "3", "--mech-experts", "--mech-mols",
                 "--mech-mols-window", "2", "--mech-output-dir", str(tmp_path / "run"), nproc=2, timeout=600)
    ops = {int(step): counts for step, counts in json.loads(out_file.read_text()).items()}
    assert sorted(ops) == [1, 2, 3, 4, 5, 6]

    def issued(step, where):  # ops of step issued from a "<file>:<function>" starting with `where`
        return sum(n for key, n in ops[step].items() if key.startswith(where))

    for step in (3, 6):  # evaluation steps: both captures inside the forward passes, the evaluation, its collectives
        assert issued(step, "megatron_mech/core/attention_logits.py:max_attention_logit") > 0, ops[step]
        assert issued(step, "megatron_mech/core/router_statistics.py:update") > 0, ops[step]   # router capture (per micro-batch)
        assert issued(step, "megatron_mech/monitors/attention") > 0, ops[step]   # the module or the package
        assert issued(step, "megatron_mech/monitors/experts.py") > 0, ops[step]
        assert any(key.endswith(":c10d.allreduce_.default") for key in ops[step]), ops[step]
    for step in (1, 2):  # MoLS's estimation window: its gradient statistics
        assert issued(step, "megatron_mech/adapters/megatron_core/mols/") > 0, ops[step]
    for step in (4, 5):
        assert ops[step] == {}, f"step {step} is no evaluation step, yet the monitors issued {ops[step]}"


def _same(a, b) -> bool:
    """Equal floats, NaN equal to NaN (a non-finite step's values are compared too)."""
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


@pytest.mark.timeout(600)
def test_deepspeed_adapter_issues_no_op_between_evaluation_steps_and_records_the_same_series(tmp_path):
    """DeepSpeed MoE Llama, ZeRO 2, 2 ranks, monitors every 3 steps, MoLS window 2, ``on_alert: stop``; the lrs of
    step 4's update are multiplied by 1e30 so that step 5 (no evaluation) goes non-finite (the worker's docstring).
    Steps 4 and 5: no op from megatron-mech's code, not even a host sync of the loss or grad norm. The reference
    for the series is what DeepSpeed itself reports per step (read by the worker, outside megatron-mech): the hook
    keeps each step's loss (this rank's, the data-parallel mean on evaluation steps), and ``mech.jsonl`` holds the
    evaluation steps and the non-finite step, each with its own step's loss and grad norm; the non-finite step's
    alert carries that step, and the stop comes at the next evaluation, where the values are read back."""
    from megatron_mech.records.sinks import read_jsonl

    out_file, run_dir = tmp_path / "ops.json", tmp_path / "run"
    run_torchrun(DEEPSPEED_WORKER, str(out_file), str(run_dir), nproc=2, timeout=540)
    result = json.loads(out_file.read_text())
    ops = {int(step): counts for step, counts in result["ops"].items()}
    assert sorted(ops) == [1, 2, 3, 4, 5, 6]

    def issued(step, where):
        return sum(n for key, n in ops[step].items() if key.startswith(where))

    for step in (3, 6):  # evaluation steps: router capture in the forward, the evaluation, its all-reduces
        assert issued(step, "megatron_mech/core/router_statistics.py:update") > 0, ops[step]
        assert issued(step, "megatron_mech/monitors/attention") > 0, ops[step]
        assert issued(step, "megatron_mech/adapters/deepspeed/engine.py") > 0, ops[step]  # the loss's data-parallel mean
        assert any(key.endswith(":c10d.allreduce_.default") for key in ops[step]), ops[step]
    for step in (1, 2):  # MoLS's estimation window: its gradient statistics
        assert issued(step, "megatron_mech/adapters/deepspeed/mols_backend.py") > 0, ops[step]
    for step in (4, 5):
        assert ops[step] == {}, f"step {step} is no evaluation step, yet megatron-mech issued {ops[step]}"

    reported = result["reported"]  # [rank][step - 1] -> DeepSpeed's loss and grad norm
    rank0 = {step: reported[0][step - 1] for step in ops}
    dp_mean = {step: sum(r[step - 1]["loss"] for r in reported) / len(reported) for step in ops}  # 2 ranks: exact
    want_losses = [dp_mean[step] if step % 3 == 0 else rank0[step]["loss"] for step in sorted(ops)]
    assert all(_same(a, b) for a, b in zip(result["hook_losses"], want_losses)), (result["hook_losses"], want_losses)
    assert len(result["hook_losses"]) == len(want_losses)

    nonfinite = [step for step in sorted(ops) if not all(math.isfinite(v) for v in rank0[step].values())]
    assert nonfinite and nonfinite[0] == 5, rank0  # the blow-up's onset, as DeepSpeed reports it
    records = {r["step"]: r for r in read_jsonl(run_dir / "mech.jsonl")}
    assert sorted(records) == sorted({3, 6} | set(nonfinite))
    for step, record in records.items():
        want_loss = dp_mean[step] if step % 3 == 0 else rank0[step]["loss"]
        assert _same(record["loss"], want_loss) and _same(record["grad_norm"], rank0[step]["grad_norm"]), record
    first = {(a["metric"], a["step"]) for a in records[5]["alerts"]}
    assert first == {(f"symptom/{name}", 5) for name, v in rank0[5].items() if not math.isfinite(v)}
    assert result["first_alert_step"] == 5
    assert result["actions"] == {"1": "continue", "2": "continue", "3": "continue", "4": "continue",
                                 "5": "continue", "6": "stop"}
