"""torchrun worker (2 gloo ranks) for tests/integration/megatron_core/test_monitors_leave_training_unchanged.py: one real DeepSpeed engine
(Llama with DeepSpeed MoE layers, ``ep_size=2``, top-2, ZeRO 2) trains 6 steps with the adapter's monitors
(attention and router, every 2 steps), then a fresh engine from the same seed trains the same 6 steps without the
adapter. Each run seeds the global random stream the same way right before its first step (DeepSpeed's top-2
gate draws from it). What each run reports comes from DeepSpeed, not megatron-mech: the loss of each rank and
``engine.get_global_grad_norm()`` per step, and a digest of every final parameter (this rank's shard included).

Usage: ``deepspeed_monitors_off_worker.py OUT.json OUTPUT_DIR``. Rank 0 writes ``{"monitored": run, "plain": run}``
to ``OUT.json`` (``run``: ``{"losses": [per rank: [...]], "grad_norms": [...], "weights_digest": [per rank: ...]}``);
``OUTPUT_DIR/mech.jsonl`` holds the monitored run's records.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from deepspeed_worker import MICRO, SEQ, VOCAB, build_engine, corpus_tokens, ds_config  # noqa: E402
from verdict import exit_without_destructors  # noqa: E402

from megatron_mech.adapters.deepspeed.engine import DeepSpeedMech  # noqa: E402

STEPS, INTERVAL, TRAINING_SEED = 6, 2, 1234


def weights_digest(engine) -> str:
    """SHA-256 over every parameter's name and bytes as this rank holds it after training."""
    digest = hashlib.sha256()
    for name, param in engine.module.named_parameters():
        digest.update(name.encode())
        digest.update(param.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def run(tokens, rank: int, world: int, output_dir: str | None) -> dict:
    from megatron_mech.adapters.deepspeed.batches import rank_batch
    from megatron_mech.adapters.deepspeed.models import deepspeed_moe_llama, moe_aux_loss

    model = deepspeed_moe_llama(vocab_size=VOCAB, seq_len=SEQ, num_experts=4, ep_size=2, k=2)
    section = {"monitors": {"interval": INTERVAL, "families": ["attention", "router"]},
               "output": {"dir": output_dir or "unused"}}
    engine = build_engine(model, ds_config(2, section), moe=True)
    mech = DeepSpeedMech.from_engine(engine, train_steps=STEPS, lr_warmup_steps=2) if output_dir else None
    torch.manual_seed(TRAINING_SEED)
    losses, grad_norms = [], []
    for step in range(STEPS):
        batch = rank_batch(tokens, step, MICRO, rank, world, SEQ)
        if mech:
            mech.before_step()
        out = engine(input_ids=batch, labels=batch)
        engine.backward(out.loss + 0.01 * moe_aux_loss(engine.module))
        if mech:
            mech.after_backward()
        engine.step()
        if mech:
            mech.after_step(out.loss)
        losses.append(float(out.loss.detach()))
        grad_norm = engine.get_global_grad_norm()
        grad_norms.append(None if grad_norm is None else float(grad_norm))
    if mech:
        mech.close()
    return {"losses": losses, "grad_norms": grad_norms, "weights_digest": weights_digest(engine)}


def main(out_file: str, output_dir: str) -> None:
    import deepspeed

    from megatron_mech.adapters.deepspeed.cpu import skip_shm_comm_build

    skip_shm_comm_build()
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    tokens = corpus_tokens()
    result = {}
    for name, directory in (("monitored", output_dir), ("plain", None)):
        mine = run(tokens, rank, world, directory)
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
        result[name] = {key: [r[key] for r in everyone] for key in mine}
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump(result, f)
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    exit_without_destructors(0)
