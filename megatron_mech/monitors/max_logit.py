"""The max-attention-logit symptom series: ``symptom/max_attn_logit``, recorded on evaluation steps by the
:class:`MaxLogitFamily` monitor.

The framework adapter installs one capture per self-attention layer (:attr:`ModelView.attention_logit_capture`);
on evaluation steps the hook arms :class:`MaxLogitRecorder`, every micro-batch's attention inputs go through
:func:`megatron_mech.core.attention_logits.max_attention_logit`, and :meth:`MaxLogitRecorder.observe` reduces the
maximum over the whole run (every layer, head, token, micro-batch and rank: one all-reduce MAX over the view's
world group, which every rank joins on every evaluation step). Between evaluation steps nothing is computed, so the
cost is one extra ``QKᵀ`` per layer and micro-batch on one step in ``interval``.

The value is logged, not alerted on by the default rules: how large a healthy maximum logit is depends on the
model and the run, and the benchmarks compare it with the monitors' alerts as the signal users watch today.
"""
from __future__ import annotations

import math
import time
from typing import Optional

import torch

from megatron_mech.core.attention_logits import max_attention_logit
from megatron_mech.monitors.protocol import Monitor, MonitorContext, Observation

__all__ = ["MAX_LOGIT_METRIC", "MaxLogitFamily", "MaxLogitRecorder"]

MAX_LOGIT_METRIC = "symptom/max_attn_logit"


class MaxLogitRecorder:
    """Collects the maximum attention logit of one evaluation step on this rank, then reduces it over all ranks.

    ``capturing`` is set by the hook (True on evaluation steps); the recorder itself is what the hook hands each
    layer's capture: calling it is :meth:`record`, with the tensors the attention kernel receives, and a capture
    reads ``capturing`` first so that between evaluation steps it does not even lay out those tensors.
    """

    def __init__(self) -> None:
        self.capturing = False
        self.seconds = 0.0
        self._max: Optional[float] = None

    def record(self, layer: int, query: torch.Tensor, key: torch.Tensor, scale: float, causal: bool,
               mask: Optional[torch.Tensor] = None) -> None:
        """One micro-batch of one layer: ``query [b, h, sq, d]``, ``key [b, g, sk, d]`` (see the core function)."""
        if not self.capturing:
            return
        started = time.perf_counter()
        value = max_attention_logit(query, key, scale, causal=causal, mask=mask)
        if self._max is None or math.isnan(value) or (not math.isnan(self._max) and value > self._max):
            self._max = value
        self.seconds += time.perf_counter() - started

    __call__ = record

    def observe(self, group=None) -> dict:
        """``{MAX_LOGIT_METRIC: value}`` over all ranks (empty if no rank captured anything); resets the step:
        ``evaluate(snapshot(), group)``.

        Collective: every rank calls it on every evaluation step. A NaN on any rank makes the result NaN."""
        return self.evaluate(self.snapshot(), group)

    def snapshot(self) -> Optional[float]:
        """This rank's maximum of the step (``None``: nothing captured), and the recording starts afresh."""
        local, self._max = self._max, None
        return local

    def evaluate(self, local: Optional[float], group=None) -> dict:
        """The maximum over every rank of ``group`` (``None``: the default group) of :meth:`snapshot`'s values:
        one all-reduce MAX."""
        values = torch.tensor([-math.inf if local is None or math.isnan(local) else local,
                               1.0 if local is not None and math.isnan(local) else 0.0,
                               1.0 if local is not None else 0.0], dtype=torch.float64)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            from megatron_mech.core.sharded import collective_device

            values = values.to(collective_device(group))
            torch.distributed.all_reduce(values, op=torch.distributed.ReduceOp.MAX, group=group)
            values = values.cpu()
        best, any_nan, any_captured = (float(v) for v in values)
        if not any_captured:
            return {}
        return {MAX_LOGIT_METRIC: math.nan if any_nan else best}


class MaxLogitFamily(Monitor):
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
        self.recorder = MaxLogitRecorder()
        self.group = view.world_group
        for capture in view.attention_logit_capture:
            capture(self.recorder)  # callable; its ``capturing`` tells the capture when to skip all work
        return True

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
        return self.recorder.evaluate(snapshot, self.group), {}  # every rank, every evaluation step (one all-reduce)
