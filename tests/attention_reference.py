"""The attention monitor run on one process, with no parallelism, over full float32 QKV weights: the reference
that the monitors of a parallel (and mixed-precision) run must reproduce."""
from __future__ import annotations

from megatron_mech.monitors import AttentionEvaluator, AttentionLayer, AttentionMonitorConfig


def single_rank_metrics(weights: dict, steps: list, layer: int, *, num_heads: int, num_query_groups: int,
                        head_dim: int, interval: int) -> dict:
    """The attention monitor's metrics of ``layer`` evaluated over its full QKV weights ``weights``
    (``{step: tensor}``, megatron-core's layout) at ``steps``, the first of them the starting snapshot:
    ``{step: metrics}`` of each evaluation, with the run's ``--mech-interval``."""
    live = weights[steps[0]].clone()
    monitor = AttentionEvaluator([AttentionLayer(layer=layer, qkv_weight=live, num_heads=num_heads,
                                                 num_query_groups=num_query_groups, head_dim=head_dim)],
                                 AttentionMonitorConfig(interval=interval))
    found = {}
    for step in steps:
        live.copy_(weights[step])
        result = monitor.observe(step)
        if result is not None:
            found[step] = result[0]
    return found
