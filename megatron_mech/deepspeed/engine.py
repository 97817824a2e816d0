"""The DeepSpeed adapter object: monitors, detectors, MoLS and output around one ``DeepSpeedEngine``.

Every rank builds it (after ``deepspeed.initialize``) and calls it at the same points of every step; the
monitors issue their collectives at the same steps, in the same order, on every rank, and a rank with nothing
to add (no tokens routed, no MoE layer) still joins. Global rank 0 writes the output.

    mech = DeepSpeedMech.from_engine(engine)            # config: the "mech" section of the DeepSpeed config
    for batch in data:
        mech.before_step()
        for micro in split(batch):                      # gradient accumulation: one engine.step per micro-batch
            loss = engine(micro); engine.backward(loss)
            mech.after_backward()                       # MoLS statistics (before engine.step)
            engine.step()
        mech.after_step(loss)                           # after the optimizer step (engine.global_steps moved)

Step numbering: ``engine.global_steps`` = optimizer steps taken (the monitors' ``step``); MoLS counts
applied steps (its scheduler wrapper is not stepped on overflow, as DeepSpeed's own schedulers are not).

What is the same on every rank (so it is saved once, with ``engine.save_checkpoint(client_state=...)``,
which DeepSpeed writes from the data-parallel writer and every rank reads back): the attention snapshots
(full weights, read directly at ZeRO 0–2 and gathered at ZeRO 3), the detectors (fed identical, reduced
metrics), the MoLS controller (fed all-reduced statistics) and the scheduler wrapper (in DeepSpeed's own
``lr_scheduler`` entry). Nothing per rank needs its own file.
"""
from __future__ import annotations

import contextlib
import logging
import math
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from megatron_mech.core.attribution import alert_lines
from megatron_mech.core.detect import Alert, DetectorRegistry
from megatron_mech.core.taxonomy import classify_parameters
from megatron_mech.deepspeed.attention import find_hf_attention
from megatron_mech.deepspeed.config import DeepSpeedMechConfig, read_section
from megatron_mech.deepspeed.mols import GradientStatistics, MoLSLRScheduler, build_controller, group_multipliers
from megatron_mech.deepspeed.router import find_gates, install_router_capture, token_group_of
from megatron_mech.monitors.attention import AttentionMonitor, AttentionMonitorConfig

__all__ = ["DeepSpeedMech", "load_checkpoint", "save_checkpoint"]

logger = logging.getLogger(__name__)
_STATE_VERSION = 1
CLIENT_STATE_KEY = "megatron_mech"


def _world_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


_SOLO = {}


def _solo_group():
    """A process group holding only this rank (created once; every rank takes part in creating all of them)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if "group" not in _SOLO:
        _SOLO["group"], _ = dist.new_subgroups(group_size=1)
    return _SOLO["group"]


class DeepSpeedMech:
    """Monitors + detectors + MoLS for one engine. Build with :meth:`from_engine`."""

    def __init__(self, engine, config: DeepSpeedMechConfig, *, output_dir: Optional[str] = None,
                 printer: Callable[[str], None] = logger.warning):
        self.engine, self.config, self.printer = engine, config, printer
        self.logging_rank = _world_rank() == 0
        self.registry = DetectorRegistry(rules=config.detector_rules())
        self.seconds: dict[str, float] = {}
        self.last_alerts: list[Alert] = []
        self.last_metrics: dict[str, float] = {}
        self.token_group = token_group_of(engine)
        model = engine.module

        gates = find_gates(model)
        monitors = config.monitors
        if monitors == ("auto",):
            monitors = ("attention", "router") if gates else ("attention",)
        self.monitors = monitors
        self.attention_sources = []
        self.attention: Optional[AttentionMonitor] = None
        if "attention" in monitors:
            self.attention_sources = find_hf_attention(model, config.attention_layout)
            device = self.attention_sources[0].buffer.device
            self.attention = AttentionMonitor(
                # A group of this rank alone: HF models under DeepSpeed hold whole attention weights on every
                # rank (no tensor parallelism), so the monitor needs no communication.
                [a.spec() for a in self.attention_sources],
                AttentionMonitorConfig(interval=config.interval, qk_terms=config.qk_terms, qk_method=config.qk_method,
                                       snapshot_device="cpu" if config.snapshot_device == "cpu" else device,
                                       save_snapshots=config.checkpoint_snapshots), tp_group=_solo_group())
        self.gates = gates
        self.router = None
        self._router_hooks = []
        if "router" in monitors:
            if not gates:
                raise ValueError("mech.monitors names 'router' but the model has no MoE router (no deepspeed.moe "
                                 "TopKGate, no HF MoE block with gate/experts)")
            self.router, self._router_hooks = install_router_capture(gates, token_group=self.token_group)

        self.mols_stats: Optional[GradientStatistics] = None
        self.mols_scheduler: Optional[MoLSLRScheduler] = None
        if config.mols is not None:
            present = set(classify_parameters(model).values())
            controller = build_controller(config.mols, present)
            self.mols_stats = GradientStatistics(engine, controller, group=self.token_group)
            self.mols_scheduler = MoLSLRScheduler(engine.lr_scheduler, engine.optimizer, controller)
            engine.lr_scheduler = self.mols_scheduler  # DeepSpeed steps it exactly where it stepped the original

        self.sinks = None
        self._jsonl_path = None
        output_dir = config.output_dir or output_dir
        if self.logging_rank:
            from megatron_mech.records.sinks import DeepSpeedMonitorSink, JsonlSink, MultiSink

            sinks = []
            if output_dir:
                self._jsonl_path = Path(output_dir) / "mech.jsonl"
                sinks.append(JsonlSink(self._jsonl_path))
            monitor = getattr(engine, "monitor", None)
            if config.engine_monitor and monitor is not None and getattr(monitor, "enabled", False):
                sinks.append(DeepSpeedMonitorSink(monitor))
            self.sinks = MultiSink(sinks) if sinks else None
        self._begun = False

    @classmethod
    def from_engine(cls, engine, config: Any = None, **kwargs) -> "DeepSpeedMech":
        """Build from the engine's own config (its ``"mech"`` section), or from ``config`` (a section dict or a
        :class:`DeepSpeedMechConfig`). Raises ``ValueError`` naming any unknown or bad ``mech`` key."""
        if not isinstance(config, DeepSpeedMechConfig):
            config = DeepSpeedMechConfig.from_dict(read_section(engine) if config is None else config)
        return cls(engine, config, **kwargs)

    # -------------------------------------------------------------------------------------------- schedule
    @property
    def step(self) -> int:
        """Optimizer steps taken so far (``engine.global_steps``)."""
        return int(self.engine.global_steps)

    def is_evaluation_step(self, step: int) -> bool:
        return step % self.config.interval == 0

    def _begin(self) -> None:
        self._begun = True
        if self.attention is not None and self.attention.snapshot_step is None \
                and self.attention.should_observe(self.step):
            with self._timed("attention"):
                self._refresh_attention()
                self.attention.observe(self.step)

    def _refresh_attention(self) -> None:
        for source in self.attention_sources:   # ZeRO-3: one gather per layer, same order on every rank
            source.refresh()

    def before_step(self) -> None:
        """Before the first forward of the step that will end with optimizer step ``self.step + 1``."""
        if not self._begun:
            self._begin()
        if self.router is not None:
            self.router.capturing = self.is_evaluation_step(self.step + 1)
        if self.mols_stats is not None:
            self.mols_stats.arm(self.mols_scheduler.iteration)

    def after_backward(self) -> None:
        """After every ``engine.backward``; at the accumulation boundary, before ``engine.step()``, reads the
        reduced gradients for MoLS (window steps only)."""
        if self.mols_stats is None:
            return
        self.mols_stats.micro_batch_done()
        if self.engine.is_gradient_accumulation_boundary() and self.mols_stats.armed:
            with self._timed("mols"):
                self.mols_stats.observe(self.mols_scheduler.iteration)

    def after_step(self, loss, extra: Optional[dict] = None) -> list[Alert]:
        """After ``engine.step()`` at the accumulation boundary. ``loss``: this rank's loss (averaged over the
        data-parallel ranks here, on evaluation steps). Returns the alerts of this step (same on every rank)."""
        step = self.step
        metrics: dict[str, float] = {}
        details: dict[str, dict] = {}
        if self.attention is not None and self.attention.should_observe(step):
            with self._timed("attention"):
                self._refresh_attention()
                observed = self.attention.observe(step)
            if observed is not None:
                metrics.update(observed[0])
                details.update(observed[1])
        if not self.is_evaluation_step(step):
            return []
        if self.router is not None:
            with self._timed("router"):
                for g in self.gates:
                    g.refresh()
                observed = self.router.observe(step)
                self.router.capturing = False
            metrics.update(observed[0])
            details.update(observed[1])
        loss_value = float(loss.detach().float().mean()) if isinstance(loss, torch.Tensor) else float(loss)
        if dist.is_available() and dist.is_initialized():
            t = torch.tensor([loss_value], dtype=torch.float64)
            dist.all_reduce(t, group=self.token_group)
            loss_value = float(t) / dist.get_world_size(self.token_group)
        metrics["symptom/loss"] = loss_value
        grad_norm = self.engine.get_global_grad_norm() if hasattr(self.engine, "get_global_grad_norm") else None
        if grad_norm is not None and math.isfinite(float(grad_norm)):
            metrics["symptom/grad_norm"] = float(grad_norm)
        with self._timed("detectors"):
            alerts = self.registry.update(step, metrics, details)
        self.last_alerts, self.last_metrics = alerts, metrics
        if self.logging_rank:
            with self._timed("output"):
                for line in alert_lines(alerts):
                    self.printer(f"[mech] ALERT step {step}: {line}")
                if self.sinks is not None:
                    from megatron_mech.records.sinks import make_record

                    record_extra = dict(extra or {})
                    if self.mols_scheduler is not None:
                        record_extra["mols"] = {"multipliers": group_multipliers(self.mols_scheduler),
                                                "phase": self.mols_scheduler.controller.phase}
                    lrs = self.engine.get_lr()
                    self.sinks.write(make_record(step, {"loss": loss_value, "lr": float(lrs[0]) if lrs else None,
                                                        "grad_norm": metrics.get("symptom/grad_norm")},
                                                 metrics, alerts, extra=record_extra))
        return alerts

    @contextlib.contextmanager
    def _timed(self, part: str):
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[part] = self.seconds.get(part, 0.0) + time.perf_counter() - started

    @property
    def monitor_seconds(self) -> float:
        """Wall time this rank spent in the monitors (snapshots, evaluations, ZeRO-3 gathers, router capture and
        reduction, MoLS statistics, detectors, output)."""
        return sum(self.seconds.values()) + (self.router.capture_seconds if self.router is not None else 0.0)

    # -------------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict:
        return {"version": _STATE_VERSION,
                "attention": self.attention.state_dict() if self.attention is not None else None,
                "router": self.router.state_dict() if self.router is not None else None,
                "detectors": self.registry.state_dict(),
                "mols": self.mols_stats.controller.state_dict() if self.mols_stats is not None else None}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or state.get("version") != _STATE_VERSION:
            raise ValueError("not a megatron-mech DeepSpeed state (wrong or missing version)")
        if self.attention is not None and state.get("attention") is not None:
            self.attention.load_state_dict(state["attention"])
        if self.router is not None:
            self.router.load_state_dict(state.get("router"))
        self.registry.load_state_dict(state["detectors"])
        if self.mols_stats is not None:
            if state.get("mols") is None:
                raise ValueError("the checkpoint has no MoLS state but mech.mols is enabled")
            self.mols_stats.controller.load_state_dict(state["mols"])
            self.mols_scheduler._apply()
        self._begun = False  # re-checks the first snapshot (taken only if the state had none)
        if self.logging_rank and self._jsonl_path is not None:
            from megatron_mech.records.sinks import JsonlSink, MultiSink

            kept = [s for s in self.sinks.sinks if not isinstance(s, JsonlSink)] if self.sinks else []
            for s in (self.sinks.sinks if self.sinks else []):
                if isinstance(s, JsonlSink):
                    s.close()
            # Drop the records a crashed run wrote after this checkpoint, so the log matches the state.
            self.sinks = MultiSink([JsonlSink(self._jsonl_path, truncate_after_step=self.step), *kept])

    def close(self) -> None:
        for h in self._router_hooks:
            h.remove()
        if self.mols_stats is not None:
            self.mols_stats.remove()
        if self.sinks is not None:
            self.sinks.close()


def save_checkpoint(engine, mech: DeepSpeedMech, save_dir, tag=None, client_state: Optional[dict] = None, **kwargs):
    """``engine.save_checkpoint`` with the monitor state in ``client_state`` (every rank calls it)."""
    state = dict(client_state or {})
    state[CLIENT_STATE_KEY] = mech.state_dict()
    return engine.save_checkpoint(save_dir, tag=tag, client_state=state, **kwargs)


def load_checkpoint(engine, mech: DeepSpeedMech, load_dir, tag=None, **kwargs):
    """``engine.load_checkpoint`` and restore the monitor state from its ``client_state``; returns DeepSpeed's
    ``(load_path, client_state)`` without our entry. Raises ``ValueError`` if the checkpoint has no state."""
    path, client_state = engine.load_checkpoint(load_dir, tag=tag, **kwargs)
    if path is None:
        raise ValueError(f"no DeepSpeed checkpoint found in {load_dir} (tag {tag})")
    client_state = dict(client_state or {})
    state = client_state.pop(CLIENT_STATE_KEY, None)
    if state is None:
        raise ValueError(f"checkpoint {path} has no {CLIENT_STATE_KEY!r} client state (saved without "
                         f"megatron_mech.deepspeed.save_checkpoint?)")
    mech.load_state_dict(state)
    return path, client_state
