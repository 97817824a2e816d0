"""The max-attention-logit symptom series: ``symptom/max_attn_logit``, recorded on evaluation steps by the
:class:`MaxLogitMonitor` monitor.

The framework adapter installs one capture per self-attention layer (:attr:`ModelView.attention_logit_capture`);
on evaluation steps the hook arms :class:`MaxLogitRecorder`, every micro-batch's attention inputs go through
:func:`megatron_mech.core.attention_logits.max_attention_logit_per_head`, and :meth:`MaxLogitRecorder.observe`
reduces the maximum over the whole run (every layer, head, token, micro-batch and rank: one all-reduce MAX over
the view's world group, which every rank joins on every evaluation step). Between evaluation steps nothing is
computed, so the cost is one extra ``QKᵀ`` per layer and micro-batch on one step in ``interval``.

The global value is logged, not alerted on by the default rules. Beside it, the maximum of each layer,
``symptom/max_attn_logit/layer{L}`` (:data:`MAX_LOGIT_LAYER_NAME`), with the global index of the query head that
holds it as the alert's detail: the monitor's level rule (:meth:`MaxLogitMonitor.rules`, its level in
:class:`megatron_mech.core.detect.LevelRules`) fires on it
from the first evaluation. Each rank holds its own heads (TP), layers (PP) and tokens (DP): the per-layer maxima
are reduced over every rank by one all-reduce MAX, and the head by a second, MIN over the ranks whose own maximum
equals the layer's (the lowest such global head on a tie), so the layer and head are exact under any layout.
"""
from __future__ import annotations

import logging
import math
import time
from typing import Dict, Mapping, Optional, Tuple

import torch

from megatron_mech.core.attention_logits import max_attention_logit_per_head
from megatron_mech.core.detect import SeriesRule
from megatron_mech.monitors.metric_names import render
from megatron_mech.monitors.protocol import Monitor, MonitorContext, Observation

__all__ = ["MAX_LOGIT_LAYER_NAME", "MAX_LOGIT_METRIC", "MaxLogitMonitor", "MaxLogitRecorder"]

logger = logging.getLogger(__name__)

MAX_LOGIT_METRIC = "symptom/max_attn_logit"
MAX_LOGIT_LAYER_NAME = MAX_LOGIT_METRIC + "/layer{L}"
"""Template of the per-layer maximum's name (:func:`~megatron_mech.monitors.metric_names.render` with ``L``)."""
_NO_HEAD = float(2 ** 53)  # above every head index: a rank without the layer's maximum offers this to the MIN


def _all_reduce(values: torch.Tensor, op, group=None) -> torch.Tensor:
    """A copy of ``values`` (CPU) reduced with ``op`` over every rank of ``group`` (``None``: the default group;
    ``values`` itself is left as it is; as is without torch.distributed)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        from megatron_mech.core.sharded import collective_device

        values = values.to(collective_device(group), copy=True)
        torch.distributed.all_reduce(values, op=op, group=group)
        values = values.cpu()
    return values


def _keep_head_maxima(layers: Dict[int, torch.Tensor], layer: int, per_head: torch.Tensor) -> None:
    """Fold one micro-batch's per-head maxima ``[h]`` into the step's of ``layer`` (a NaN stays NaN)."""
    held = layers.get(layer)
    layers[layer] = per_head if held is None else torch.maximum(held, per_head)


def _local_layer_maxima(layers: Mapping[int, torch.Tensor], head_offsets: Mapping[int, int],
                        num_layers: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """This rank's per-layer maxima packed for one MAX all-reduce, float64 ``[3, num_layers]`` (rows: the maximum,
    ``-inf`` when NaN or not held; 1 where a head is NaN; 1 where captured), and the global head of each layer's
    maximum (its first NaN head when one is NaN), float64 ``[num_layers]``, :data:`_NO_HEAD` where not held."""
    packed = torch.zeros(3, num_layers, dtype=torch.float64)
    packed[0] = -math.inf
    heads = torch.full((num_layers,), _NO_HEAD, dtype=torch.float64)
    for layer, per_head in layers.items():
        nan = torch.isnan(per_head)
        local = int(torch.nonzero(nan)[0]) if bool(nan.any()) else int(torch.argmax(per_head))
        packed[0, layer] = -math.inf if bool(nan.any()) else float(per_head[local])
        packed[1, layer] = 1.0 if bool(nan.any()) else 0.0
        packed[2, layer] = 1.0
        heads[layer] = float(head_offsets.get(layer, 0) + local)
    return packed, heads


def _layer_metrics(layers: Mapping[int, torch.Tensor], head_offsets: Mapping[int, int],
                   num_layers: int, group=None) -> Tuple[dict, dict]:
    """``(metrics, details)`` of the per-layer maxima over every rank: ``{name: max}`` and ``{name: {"layer": L,
    "head": H}}`` for every layer some rank captured. Collective (two all-reduces), every rank calls it."""
    packed, heads = _local_layer_maxima(layers, head_offsets, num_layers)
    best = _all_reduce(packed, torch.distributed.ReduceOp.MAX if torch.distributed.is_available() else None, group)
    # A rank offers its head only where its own maximum is the layer's (exact: the MAX moved the same float64)
    holds = ((best[1] > 0) & (packed[1] > 0)) | ((best[1] == 0) & (packed[2] > 0) & (packed[0] == best[0]))
    offers = torch.where(holds, heads, torch.full_like(heads, _NO_HEAD))
    head = _all_reduce(offers, torch.distributed.ReduceOp.MIN if torch.distributed.is_available() else None, group)
    metrics, details = {}, {}
    for layer in range(num_layers):
        if best[2, layer] <= 0:
            continue
        name = render(MAX_LOGIT_LAYER_NAME, L=layer)
        metrics[name] = math.nan if best[1, layer] > 0 else float(best[0, layer])
        details[name] = {"layer": layer} if head[layer] >= _NO_HEAD else {"layer": layer, "head": int(head[layer])}
    return metrics, details


class MaxLogitRecorder:
    """Collects the maximum attention logit of one evaluation step on this rank, then reduces it over all ranks.

    ``capturing`` is set by the hook (True on evaluation steps); the recorder itself is what the hook hands each
    layer's capture: calling it is :meth:`record`, with the tensors the attention kernel receives, and a capture
    reads ``capturing`` first so that between evaluation steps it does not even lay out those tensors.
    """

    def __init__(self, num_layers: int = 0, head_offsets: Optional[Mapping[int, int]] = None) -> None:
        self.capturing = False
        self.seconds = 0.0
        self._max: Optional[float] = None
        self.num_layers = num_layers
        """Layers of the whole model (the same on every rank): the per-layer maxima's length; 0: none kept."""
        self.head_offsets = dict(head_offsets or {})
        """Global index of this rank's first query head, per layer (TP: ``tp_rank · heads per rank``)."""
        self._layers: Dict[int, torch.Tensor] = {}
        self._warned = False

    def record(self, layer: int, query: torch.Tensor, key: torch.Tensor, scale: float, causal: bool,
               mask: Optional[torch.Tensor] = None) -> None:
        """One micro-batch of one layer: ``query [b, h, sq, d]``, ``key [b, g, sk, d]`` (see the core function)."""
        if not self.capturing:
            return
        started = time.perf_counter()
        per_head = max_attention_logit_per_head(query, key, scale, causal=causal, mask=mask)
        value = math.nan if bool(torch.isnan(per_head).any()) else float(per_head.max())
        self._keep_layer(layer, per_head)
        if self._max is None or math.isnan(value) or (not math.isnan(self._max) and value > self._max):
            self._max = value
        self.seconds += time.perf_counter() - started

    __call__ = record

    def _keep_layer(self, layer: int, per_head: torch.Tensor) -> None:
        if 0 <= layer < self.num_layers:
            _keep_head_maxima(self._layers, layer, per_head)
        elif not self._warned:
            self._warned = True
            logger.warning(f"[mech] max attention logit: layer {layer} is outside the model's {self.num_layers} "
                           f"layers; its per-layer maximum is not recorded (the global one is)")

    def observe_layers(self, group=None) -> Tuple[dict, dict]:
        """The per-layer maxima over all ranks of ``group`` (``None``: the default group), ``(metrics, details)``
        (:data:`MAX_LOGIT_LAYER_NAME`, detail ``{"layer", "head"}``); resets them. Collective: every rank calls it on
        every evaluation step."""
        layers, self._layers = self._layers, {}
        return self._layer_metrics(layers, group)

    def observe(self, group=None) -> dict:
        """``{MAX_LOGIT_METRIC: value}`` over all ranks of ``group`` (empty if no rank captured anything); resets the
        step.

        Collective: every rank calls it on every evaluation step. A NaN on any rank makes the result NaN."""
        local, self._max = self._max, None
        return _global_maximum(local, group)

    def snapshot(self) -> tuple:
        """This rank's values of the step, ``(maximum or None, {layer: per-head maxima [h]})``, and the recording
        starts afresh (training thread; no collective)."""
        taken = (self._max, self._layers)
        self._max, self._layers = None, {}
        return taken

    def evaluate(self, snapshot: tuple, group=None) -> tuple:
        """``(metrics, details)`` of :meth:`snapshot`'s values over every rank of ``group``: the global maximum (one
        all-reduce MAX), then the per-layer maxima and their heads (two more)."""
        local, layers = snapshot
        metrics = _global_maximum(local, group)
        layer_metrics, details = self._layer_metrics(layers, group)
        return {**metrics, **layer_metrics}, details

    def _layer_metrics(self, layers: Mapping[int, torch.Tensor], group) -> Tuple[dict, dict]:
        if not self.num_layers:
            return {}, {}
        return _layer_metrics(layers, self.head_offsets, self.num_layers, group)


def _global_maximum(local: Optional[float], group=None) -> dict:
    """``{MAX_LOGIT_METRIC: value}``: the maximum of every rank's ``local`` (``None``: nothing captured) over
    ``group``, NaN if any is NaN; empty if no rank captured anything. Collective (one all-reduce MAX)."""
    values = torch.tensor([-math.inf if local is None or math.isnan(local) else local,
                           1.0 if local is not None and math.isnan(local) else 0.0,
                           1.0 if local is not None else 0.0], dtype=torch.float64)
    values = _all_reduce(values, torch.distributed.ReduceOp.MAX if torch.distributed.is_available() else None, group)
    best, any_nan, any_captured = (float(v) for v in values)
    if not any_captured:
        return {}
    return {MAX_LOGIT_METRIC: math.nan if any_nan else best}


class MaxLogitMonitor(Monitor):
    """The max-attention-logit series as a monitor family: runs when any rank's framework captures attention inputs
    (:attr:`ModelView.attention_logit_capture <megatron_mech.model_view.ModelView.attention_logit_capture>`, agreed
    by every rank); its value is already reduced over every rank (not per pipeline stage). Nothing to checkpoint:
    the maximum is reset at every evaluation."""

    name = "max_logit"
    per_stage = False

    def __init__(self) -> None:
        self.recorder: Optional[MaxLogitRecorder] = None
        self.group = None   # the view's world group (None: the default group)

    def setup(self, view, context: MonitorContext) -> bool:
        if not context.any_rank(bool(view.attention_logit_capture)):
            return False
        self.group = view.world_group
        self.recorder = MaxLogitRecorder(_model_layers(view, self.group),
                                         {a.layer: a.head_offset for a in view.attention_layers})
        for capture in view.attention_logit_capture:
            capture(self.recorder)  # callable; its ``capturing`` tells the capture when to skip all work
        return True

    def rules(self, settings) -> list:
        """The per-layer maximum's level rule (``settings.levels.max_logit_level``; none when it is 0), armed from
        the first evaluation; its alerts keep the family ``attention``: the series says how the attention runs."""
        level = settings.levels.max_logit_level
        if not level:
            return []
        return [SeriesRule(render(MAX_LOGIT_LAYER_NAME, L="*"), "attention", direction="up", kind="level",
                           level=float(level), persistence=1)]

    def describe(self, total_layers: int) -> str:
        return "max attention logit"

    @property
    def capture_seconds(self) -> float:
        return self.recorder.seconds if self.recorder is not None else 0.0

    def before_step(self, step: int, evaluating: bool) -> None:
        self.recorder.capturing = evaluating

    def snapshot(self, step: int):
        self.recorder.capturing = False
        return self.recorder.snapshot()

    def evaluate(self, step: int, snapshot) -> Observation:
        # every rank, every evaluation step: one all-reduce for the global maximum, two of one value per layer
        return self.recorder.evaluate(snapshot, self.group)


def _model_layers(view, group=None) -> int:
    """The model's attention layers, the same on every rank: one past the highest global layer index any rank
    holds (each pipeline stage holds its own). Collective over ``group`` (one all-reduce MAX)."""
    local = max((a.layer for a in view.attention_layers), default=-1) + 1
    return int(_all_reduce(torch.tensor([float(local)], dtype=torch.float64),
                           torch.distributed.ReduceOp.MAX if torch.distributed.is_available() else None, group)[0])
