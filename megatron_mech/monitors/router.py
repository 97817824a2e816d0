"""The router-side monitor: routing statistics and router-weight geometry per MoE layer, framework-free.

A framework adapter hands over, per MoE layer, the live router weight ``[E, d]`` and its top-k, and calls
:meth:`RouterEvaluator.record` with the router's raw logits ``[tokens..., E]`` from inside the router's forward
(Megatron: a wrapped ``TopKRouter.gating``; DeepSpeed: a forward-pre-hook on the gate). Recording is switched
on only for the steps that will be evaluated (``capturing``), so a monitor at interval δ pays for the extra
softmax on 1/δ of the steps, and with ``token_stride`` n on every n-th token of those steps' micro-batches.

At an evaluation the per-layer :class:`~megatron_mech.core.router_statistics.RoutingStats` are reduced over
``token_group`` — exactly the ranks that together hold every token of the step (data × expert parallel, plus tensor
parallel when sequence parallelism splits tokens) — in two collectives for all layers together, so the
result equals one process seeing every token. The router weight is replicated on those ranks, so its
geometry needs no communication.

Metrics (``router/layer{L}/...``): every key of :meth:`RoutingStats.summary` plus ``mean_cosine``,
``conditioning`` and ``mean_deviation`` of the router weight; details carry ``{"layer": L}`` and, for the
busiest expert, ``{"expert": e, "expert_load": fraction}`` for attribution.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from megatron_mech.core.router_statistics import RoutingStats, all_reduce_many, router_weight_geometry
from megatron_mech.monitors.metric_names import render

__all__ = ["ROUTER_NAME", "RouterLayer", "RouterEvaluator", "expert_share_excess"]

ROUTER_NAME = "router/layer{L}/{statistic}"
"""Every router series' name (:mod:`megatron_mech.monitors.metric_names` syntax): ``statistic`` is a key of
:meth:`RoutingStats.summary <megatron_mech.core.router_statistics.RoutingStats.summary>` or of the router weight's
geometry (``mean_cosine``, ``conditioning``, ``mean_deviation``), and ``expert_share_excess``."""


def expert_share_excess(share: float, num_experts: int, topk: int):
    """The busiest expert's share of a layer's top-k assignments, normalized from balanced to the most a top-k
    router allows: ``(share − 1/E) / (1/k − 1/E)`` — 0 when every expert gets 1/E, 1 when the expert is in every
    token's top-k (k distinct experts per token: at most 1/k). None when ``k = E`` (every expert in every top-k:
    no imbalance is possible)."""
    if topk >= num_experts:
        return None
    return (share - 1.0 / num_experts) / (1.0 / topk - 1.0 / num_experts)


@dataclass(frozen=True)
class RouterLayer:
    """One MoE layer's router on this rank."""

    layer: int                 # global layer index (for names)
    weight: torch.Tensor       # live router weight [E, d] (replicated across TP/DP)
    topk: int


class RouterEvaluator:
    """An evaluation, not a monitor: the hook runs
    :class:`~megatron_mech.monitors.router_monitor.RouterMonitor`, which drives it.

    Args:
        layers: this rank's MoE routers.
        token_group: the ranks that together hold every token of a step (None: this rank alone).
        num_bins: bins of the normalised-entropy histogram.
        token_stride: record every n-th token of each micro-batch (a systematic sample; 1: every token). The cost
            of a recorded micro-batch falls by about n; the summaries are those of the sampled tokens.
    """

    def __init__(self, layers: Sequence[RouterLayer], token_group=None, num_bins: int = 20, token_stride: int = 1):
        self.layers = {spec.layer: spec for spec in layers}
        if len(self.layers) != len(layers):
            raise ValueError("RouterEvaluator got the same layer index twice")
        if isinstance(token_stride, bool) or not isinstance(token_stride, int) or token_stride < 1:
            raise ValueError(f"token_stride must be an int >= 1, got {token_stride!r}")
        self.token_stride = token_stride
        self.token_group = token_group
        self.stats = {spec.layer: RoutingStats(spec.weight.shape[0], num_bins) for spec in layers}
        self.capturing = False
        self.capture_seconds = 0.0  # wall time spent in record() while capturing (overhead accounting)

    def record(self, layer: int, logits: torch.Tensor) -> None:
        """Add one micro-batch of raw router logits ``[tokens..., E]`` of ``layer`` (only while capturing).

        Activation recompute runs the router's forward a second time, from inside the backward pass; that
        second call is skipped (``torch._C._current_graph_task_id()`` is -1 outside autograd's backward), so
        each token is counted once with ``--recompute-granularity full|selective``.
        """
        if self.capturing and torch._C._current_graph_task_id() == -1:
            started = time.perf_counter()
            if self.token_stride > 1:      # a strided view: only the sampled rows are read and upcast
                logits = logits.detach().reshape(-1, logits.shape[-1])[::self.token_stride]
            self.stats[layer].update(logits, self.layers[layer].topk)
            self.capture_seconds += time.perf_counter() - started

    def observe(self, step: int) -> tuple[dict[str, float], dict[str, dict]]:
        """Reduce what was recorded since the last call, return ``(metrics, details)`` and reset:
        ``evaluate(step, snapshot(step))``.

        Every rank of ``token_group`` must call this at the same steps (two collectives, all layers).
        """
        return self.evaluate(step, self.snapshot(step))

    def snapshot(self, step: int) -> dict:
        """What the evaluation reads, taken on the training thread without a collective: per layer the statistics
        recorded since the last call (the recording starts afresh) and a copy of the router weight ``[E, d]``."""
        return {layer: (self.stats[layer].taken(), self.layers[layer].weight.detach().clone())
                for layer in sorted(self.stats)}

    def evaluate(self, step: int, taken: dict) -> tuple[dict[str, float], dict[str, dict]]:
        """``(metrics, details)`` of :meth:`snapshot`'s copy: the statistics reduced over ``token_group`` (two
        collectives, all layers), the geometry of the copied weights."""
        all_reduce_many([taken[layer][0] for layer in sorted(taken)], self.token_group)
        metrics: dict[str, float] = {}
        details: dict[str, dict] = {}
        for layer in sorted(taken):
            stats, weight = taken[layer]
            summary = stats.summary()
            geometry = router_weight_geometry(weight)
            summary.update(mean_cosine=geometry.mean_cosine, conditioning=geometry.conditioning,
                           mean_deviation=geometry.mean_deviation)
            detail = {"layer": layer}
            if stats.count > 0:
                load = stats.load_fraction
                busiest = int(torch.argmax(load))
                detail.update(expert=busiest, expert_load=float(load[busiest]))
                excess = expert_share_excess(float(load[busiest]), stats.num_experts, self.layers[layer].topk)
                if excess is not None:
                    summary["expert_share_excess"] = excess
            for key, value in summary.items():
                name = render(ROUTER_NAME, L=layer, statistic=key)
                metrics[name] = float(value)
                details[name] = detail
        return metrics, details

    def state_dict(self) -> dict:
        # Statistics are reset after every evaluation and capture spans one step, so nothing here needs to
        # survive a restart except the configuration, which the adapter rebuilds from the model.
        return {"layers": sorted(self.stats)}

    def load_state_dict(self, state: Optional[dict]) -> None:
        if state and sorted(state.get("layers", [])) != sorted(self.stats):
            raise ValueError(f"router monitor state is for MoE layers {state.get('layers')}, but this model has "
                             f"{sorted(self.stats)}")
