"""A short real MechHook run in one process for the writer tests: a real attention monitor on real weights (two
layers of four heads, per-head Δ2 entropies), the real detectors and the hook's own sinks (``mech.jsonl``,
TensorBoard when asked). The loss jumps at ``SPIKE``, which fires a symptom alert there."""
from __future__ import annotations

import torch

from megatron_mech.config import DetectorOverrides, MechConfig, MonitorConfig, OutputConfig
from megatron_mech.hook import MechHook
from megatron_mech.model_view import ModelView
from megatron_mech.monitors.attention import AttentionLayer
from megatron_mech.records.sinks import JSONL_NAME, read_jsonl

LAYERS, HEADS, GROUPS, HEAD_DIM, D_MODEL = 2, 4, 2, 8, 32
SPIKE = 12
STEPS = 16
INTERVAL = 2


def loss_at(step: int) -> float:
    return 5.0 - 0.01 * step + (50.0 if step >= SPIKE else 0.0)


def run_hook(run_dir, *, tensorboard_dir=None, writer_level: str | None = None) -> list[dict]:
    """Train ``STEPS`` steps of deterministic updates with the hook writing into ``run_dir`` (TensorBoard at
    ``writer_level``, else the default level: full for this small model); returns the records of its
    ``mech.jsonl``."""
    config = MechConfig(monitors=MonitorConfig(families=("attention",), interval=INTERVAL, qk_terms=("delta2",)),
                        detector=DetectorOverrides(warmup=0, baseline=3, persistence=1),
                        output=OutputConfig(dir=str(run_dir), tensorboard_dir=tensorboard_dir and str(tensorboard_dir),
                                            **({"writer_level": writer_level} if writer_level else {})))
    gen = torch.Generator().manual_seed(0)
    rows = (HEADS + 2 * GROUPS) * HEAD_DIM
    weights = [torch.randn(rows, D_MODEL, generator=gen) for _ in range(LAYERS)]
    hook = MechHook(config, train_steps=STEPS)
    hook.setup(ModelView(attention_layers=[AttentionLayer(i, w, HEADS, GROUPS, HEAD_DIM)
                                           for i, w in enumerate(weights)]), None)
    for step in range(1, STEPS + 1):
        hook.before_step(step)
        step_gen = torch.Generator().manual_seed(1000 + step)
        with torch.no_grad():
            for w in weights:
                w.add_(1e-2 * torch.randn(w.shape, generator=step_gen))
        hook.after_optimizer_step(step, loss=loss_at(step), grad_norm=1.0 + step / 100, lr=1e-3)
    hook.close()
    return read_jsonl(run_dir / JSONL_NAME)
