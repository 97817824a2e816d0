"""torchrun worker (2 gloo ranks) for tests/integration/megatron_core/test_idle_steps.py: a real DeepSpeed engine trains under
:class:`op_attribution.OpsPerStep`, which attributes every torch op (collectives and host syncs included) to the code
that issued it; every op of megatron-mech's code (the adapter included; not the model helpers this script builds its
model and loss with) is counted, per optimizer step, from
``DeepSpeedMech.before_step`` to the end of ``DeepSpeedMech.after_step`` (the forward hooks and the MoLS scheduler
wrapper run in between; the adapter's one-time set-up at the first ``before_step`` is not counted).

Usage: ``deepspeed_idle_ops_worker.py OUT.json OUTPUT_DIR``. Llama with DeepSpeed MoE layers (``ep_size=2``,
top-2), ZeRO 2, monitors every 3 steps, MoLS with a window of 2 steps, ``on_alert: stop``, 6 steps; at step 4 an
extension of this script multiplies the lrs by 1e30, so the loss and grad norm of step 5 (no evaluation step) are
non-finite. Alongside, independently of megatron-mech, the script reads what DeepSpeed reports for each step: the
loss of each rank and ``engine.get_global_grad_norm()`` (after ``after_step``, outside the counted span).

Rank 0 writes ``{"ops": {step: {"<file>:<function>:<op>": count}}, "reported": [per rank: [{"loss", "grad_norm"}
per step]], "actions": {step: action}, "hook_losses": [...], "first_alert_step": int}`` to ``OUT.json``;
``OUTPUT_DIR/mech.jsonl`` holds the records.
"""
from __future__ import annotations

import json
import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

import torch.distributed as dist  # noqa: E402
from deepspeed_worker import MICRO, SEQ, VOCAB, build_engine, corpus_tokens, ds_config  # noqa: E402
from verdict import exit_without_destructors  # noqa: E402
from op_attribution import OpsPerStep  # noqa: E402  (tests/workers/, the script's directory)

from megatron_mech.adapters.deepspeed.engine import DeepSpeedMech  # noqa: E402
from megatron_mech.hook import Extension  # noqa: E402

STEPS, INTERVAL, BLOW_UP_STEP = 6, 3, 4

PACKAGE = os.path.join(REPO_ROOT, "megatron_mech")
ADAPTERS = os.path.join(PACKAGE, "adapters")
ADAPTER = os.path.join(ADAPTERS, "deepspeed")
MODEL_HELPERS = os.path.join(ADAPTER, "models.py")  # this script's model and loss, not monitoring


def _ours_but(folder: str, left_out: str) -> list:
    return [os.path.join(folder, name) for name in sorted(os.listdir(folder)) if name != left_out]


# every path of the package counts as ours, except the model helpers
ops = OpsPerStep(_ours_but(PACKAGE, "adapters") + _ours_but(ADAPTERS, "deepspeed") + _ours_but(ADAPTER, "models.py"),
                 other=[MODEL_HELPERS, os.path.abspath(__file__), os.path.join(REPO_ROOT, "tests") + os.sep],
                 contains=[os.sep + "deepspeed" + os.sep, os.sep + "transformers" + os.sep])
real_setup, real_before, real_after = DeepSpeedMech._setup, DeepSpeedMech.before_step, DeepSpeedMech.after_step


def before_step(self):
    if not self._is_setup:
        real_setup(self)  # once, before the first step: not a step's cost
    ops.open(self.step + 1)
    return real_before(self)


def after_step(self, loss, extra=None):
    try:
        return real_after(self, loss, extra)
    finally:
        ops.close()


DeepSpeedMech.before_step, DeepSpeedMech.after_step = before_step, after_step


class LrBlowUp(Extension):
    """Multiplies every lr of one step's update by 1e30 (MoLS's scheduler wrapper sets them again afterwards)."""

    name = "lr_blow_up"

    def before_optimizer_step(self, optimizer, step):
        if step == BLOW_UP_STEP:
            for group in optimizer.param_groups:
                group["lr"] *= 1e30


def main(out_file: str, output_dir: str) -> None:
    import deepspeed

    from megatron_mech.adapters.deepspeed.batches import rank_batch
    from megatron_mech.adapters.deepspeed.cpu import skip_shm_comm_build
    from megatron_mech.adapters.deepspeed.models import deepspeed_moe_llama, moe_aux_loss

    skip_shm_comm_build()
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    tokens = corpus_tokens()
    model = deepspeed_moe_llama(vocab_size=VOCAB, seq_len=SEQ, num_experts=4, ep_size=2, k=2)
    section = {"monitors": {"interval": INTERVAL}, "mols": {"enabled": True, "window": 2}, "on_alert": "stop",
               "output": {"dir": output_dir}}
    engine = build_engine(model, ds_config(2, section), moe=True)
    mech = DeepSpeedMech.from_engine(engine, train_steps=STEPS, lr_warmup_steps=2, extensions=[LrBlowUp()])
    reported, actions = [], {}
    with ops:
        for step in range(1, STEPS + 1):
            batch = rank_batch(tokens, step - 1, MICRO, rank, world, SEQ)
            mech.before_step()
            out = engine(input_ids=batch, labels=batch)
            engine.backward(out.loss + 0.01 * moe_aux_loss(engine.module))
            mech.after_backward()
            engine.step()
            actions[step] = mech.after_step(out.loss).value
            grad_norm = engine.get_global_grad_norm()
            reported.append({"loss": float(out.loss.detach()),
                             "grad_norm": None if grad_norm is None else float(grad_norm)})
    state = mech.state_dict()
    mech.close()
    everyone = [None] * world
    dist.all_gather_object(everyone, reported)
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump({"ops": ops.as_json(), "reported": everyone, "actions": actions,
                       "hook_losses": state["losses"], "first_alert_step": state["first_alert_step"]}, f)
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    exit_without_destructors(0)
