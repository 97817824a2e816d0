"""Between evaluation steps the monitors cost nothing: no tensor op, no host sync, no collective (torchrun + gloo).

A real megatron-core MoE GPT (2 ranks, EP=2) trains 6 steps with every monitor that touches the forward pass or
the step: attention, router capture, the max-attention-logit capture, the expert monitor and MoLS (window of 2
steps), evaluating every 3 steps. A ``TorchDispatchMode`` (tests/workers/idle_step_ops_worker.py) attributes each
torch op to the code that issued it. The reference is the evaluation grid itself: steps 3 and 6 evaluate, so the
monitors' ops (the captures' and the evaluation's, with their all-reduces) must show there; steps 1 and 2 are
MoLS's estimation window, where its gradient statistics must show; steps 4 and 5 are neither, and there the
monitoring code must issue no op at all.
"""
import json

from dist_utils import REPO_ROOT, run_torchrun

WORKER = REPO_ROOT / "tests" / "workers" / "idle_step_ops_worker.py"
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
        assert issued(step, "megatron_mech/core/router.py:update") > 0, ops[step]   # router capture (per micro-batch)
        assert issued(step, "megatron_mech/monitors/attention") > 0, ops[step]   # the module or the package
        assert issued(step, "megatron_mech/monitors/experts.py") > 0, ops[step]
        assert any(key.endswith(":c10d.allreduce_.default") for key in ops[step]), ops[step]
    for step in (1, 2):  # MoLS's estimation window: its gradient statistics
        assert issued(step, "megatron_mech/megatron/mols/") > 0, ops[step]
    for step in (4, 5):
        assert ops[step] == {}, f"step {step} is no evaluation step, yet the monitors issued {ops[step]}"
