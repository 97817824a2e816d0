"""megatron-core adapter: find the attention and router modules, wire the monitors in, write the output.

This module is thin on purpose: it knows megatron-core's module names, layouts and process groups, and
hands tensors to the framework-free monitors (:mod:`megatron_mech.monitors`) and detectors
(:mod:`megatron_mech.core.detect`). It is used by our megatron-core training entry point
(``launch_scripts/pretrain_gpt_mech.py``) and by the Megatron-LM patch set (``patches/``):

    parser = argparse.ArgumentParser(); add_arguments(parser)         # or extra_args_provider=add_arguments
    mech = MegatronMech.from_args(args, model_chunks, output_dir=...)  # after the model is built, every rank
    for step in ...:
        mech.begin(start_step)                                            # first snapshot (or resume state)
    mech.before_step(step)                                        # arms router capture on evaluation steps
        ... forward_backward_func(...); optimizer.step() ...
        mech.after_step(step, loss=..., lr=..., grad_norm=...)        # monitors, detectors, sinks
    state = mech.state_dict()  /  mech.load_state_dict(state)          # with the checkpoint (per rank)

Every rank must call ``before_step``/``after_step`` at every step: the monitors issue their collectives on
the same steps, in the same order, on every rank (ranks without MoE layers still join the router reduction
with nothing to add). Only the logging rank writes output.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from megatron_mech.core.attribution import alert_lines
from megatron_mech.core.detect import Alert, DetectorRegistry, default_rules
from megatron_mech.monitors.attention import AttentionLayer, AttentionMonitor, AttentionMonitorConfig
from megatron_mech.monitors.router import RouterLayer, RouterMonitor

__all__ = ["MechConfig", "MegatronMech", "add_arguments", "find_attention_layers", "find_routers",
           "validate_parallel_sizes"]

MONITOR_FAMILIES = ("attention", "router")


# ------------------------------------------------------------------------------------------------ arguments
def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add megatron-mech's ``--mech-*`` flags. Usable as Megatron-LM's ``extra_args_provider``."""
    group = parser.add_argument_group("megatron-mech monitors")
    group.add_argument("--mech-monitors", nargs="*", default=["auto"],
                       choices=[*MONITOR_FAMILIES, "auto", "none"],
                       help="monitor families to run. 'auto' (default): attention, plus router when the model has "
                            "MoE routers; 'none' disables all; naming 'router' on a dense model is an error")
    group.add_argument("--mech-interval", type=int, default=10,
                       help="evaluate every δ optimizer steps; ΔW is the change over those δ steps")
    group.add_argument("--mech-dw-scope", choices=("global", "slice"), default="global",
                       help="global: exact spectra of whole TP-split matrices (one Gram all-reduce); "
                            "slice: per-shard spectra, no communication")
    group.add_argument("--mech-qk-terms", nargs="+", choices=("delta1", "delta2", "delta3"),
                       default=["delta1", "delta2", "delta3"], help="QK-increment terms to compute per head")
    group.add_argument("--mech-qk-method", choices=("gram", "qr"), default="gram",
                       help="core of the compressed QK spectra (gram: float64 Grams + eigh; qr: thin QR)")
    group.add_argument("--mech-all-linears", action="store_true",
                       help="also ΔW spectra of every dense linear (attention output, MLP fc1/fc2), exact across TP")
    group.add_argument("--mech-snapshot-device", choices=("cpu", "device"), default="cpu",
                       help="where the W_{t-δ} snapshots live (cpu: host memory, no accelerator memory)")
    group.add_argument("--mech-no-checkpoint-snapshots", action="store_true",
                       help="do not save snapshots with the checkpoint (smaller checkpoints; after a resume "
                            "the first interval re-snapshots and is skipped)")
    group.add_argument("--mech-output-dir", default=None,
                       help="where mech.jsonl goes (default: --save, else ./runs/mech)")
    group.add_argument("--mech-wandb-project", default=None, help="also log to this W&B project")
    group.add_argument("--mech-on-alert", choices=("log", "checkpoint", "stop"), default="log",
                       help="on the first alert of a run: log only; save a checkpoint (with --save) and go on; or "
                            "save and stop cleanly on every rank")
    group.add_argument("--mech-detector-warmup", type=int, default=None,
                       help="override the evaluations ignored before the baseline (default: per rule)")
    group.add_argument("--mech-detector-baseline", type=int, default=None,
                       help="override the evaluations in the baseline window (default: per rule)")
    group.add_argument("--mech-detector-threshold", type=float, default=None,
                       help="override the alert score threshold (default: per rule)")
    group.add_argument("--mech-detector-persistence", type=int, default=None,
                       help="override the consecutive evaluations needed for an alert (default: per rule)")
    return parser


@dataclass
class MechConfig:
    """Validated ``--mech-*`` settings (see :func:`add_arguments`)."""

    monitors: tuple = ("auto",)
    interval: int = 10
    dw_scope: str = "global"
    qk_terms: tuple = ("delta1", "delta2", "delta3")
    qk_method: str = "gram"
    snapshot_device: str = "cpu"
    checkpoint_snapshots: bool = True
    all_linears: bool = False
    output_dir: Optional[str] = None
    wandb_project: Optional[str] = None
    detector_overrides: dict = field(default_factory=dict)
    on_alert: str = "log"

    def __post_init__(self):
        if self.on_alert not in ("log", "checkpoint", "stop"):
            raise ValueError(f"--mech-on-alert must be log, checkpoint or stop, got {self.on_alert!r}")
        monitors = tuple(self.monitors)
        for special in ("none", "auto"):
            if special in monitors and len(monitors) > 1:
                raise ValueError(f"--mech-monitors: '{special}' cannot be combined with {monitors}")
        if monitors == ("none",):
            monitors = ()
        if monitors == ("auto",):
            self.monitors = monitors
            monitors = ()
        unknown = [m for m in monitors if m not in MONITOR_FAMILIES]
        if unknown:
            raise ValueError(f"--mech-monitors: unknown monitor family {unknown}; expected {MONITOR_FAMILIES}")
        if self.monitors != ("auto",):
            self.monitors = monitors
        if int(self.interval) != self.interval or self.interval < 1:
            raise ValueError(f"--mech-interval must be a positive integer, got {self.interval}")
        if self.dw_scope not in ("global", "slice"):
            raise ValueError(f"--mech-dw-scope must be 'global' or 'slice', got {self.dw_scope!r}")
        if self.snapshot_device not in ("cpu", "device"):
            raise ValueError(f"--mech-snapshot-device must be 'cpu' or 'device', got {self.snapshot_device!r}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "MechConfig":
        overrides = {key: getattr(args, f"mech_detector_{key}") for key in
                     ("warmup", "baseline", "threshold", "persistence")
                     if getattr(args, f"mech_detector_{key}", None) is not None}
        return cls(monitors=tuple(args.mech_monitors or ("none",)), interval=args.mech_interval,
                   dw_scope=args.mech_dw_scope, qk_terms=tuple(args.mech_qk_terms), qk_method=args.mech_qk_method,
                   snapshot_device=args.mech_snapshot_device,
                   checkpoint_snapshots=not args.mech_no_checkpoint_snapshots,
                   all_linears=bool(getattr(args, "mech_all_linears", False)),
                   output_dir=args.mech_output_dir, wandb_project=args.mech_wandb_project,
                   detector_overrides=overrides, on_alert=getattr(args, "mech_on_alert", "log"))

    def detector_rules(self):
        """The default rules with the command-line overrides applied to every rule."""
        import dataclasses

        return [dataclasses.replace(rule, **self.detector_overrides) for rule in default_rules()]


def validate_parallel_sizes(world_size: int, tp: int, ep: int = 1, pp: int = 1, num_experts: Optional[int] = None,
                            num_query_groups: Optional[int] = None) -> None:
    """Raise ``ValueError`` for a parallel layout that megatron-core would reject later (or hang on)."""
    for name, value in (("tensor-model-parallel-size", tp), ("expert-model-parallel-size", ep),
                        ("pipeline-model-parallel-size", pp)):
        if value < 1:
            raise ValueError(f"--{name} must be >= 1, got {value}")
    if world_size % (tp * pp):
        raise ValueError(f"world size {world_size} is not divisible by TP×PP = {tp}×{pp}")
    if ep > 1:
        if num_experts is None:
            raise ValueError(f"--expert-model-parallel-size {ep} needs --num-experts")
        if num_experts % ep:
            raise ValueError(f"--num-experts {num_experts} is not divisible by --expert-model-parallel-size {ep}")
        # megatron-core's expert grid is EP × expert-TP (= TP by default) × PP and must tile the world
        if world_size % (ep * tp * pp):
            raise ValueError(f"world size {world_size} is not divisible by EP×TP×PP = {ep}×{tp}×{pp} "
                             f"(experts are split over EP and, by default, TP)")
    if num_query_groups is not None and num_query_groups % tp:
        raise ValueError(f"--num-query-groups {num_query_groups} is not divisible by TP {tp}: the monitors need "
                         f"whole query groups per tensor-parallel rank")


# ------------------------------------------------------------------------------------------------ discovery
def _unwrap(module: torch.nn.Module) -> torch.nn.Module:
    while hasattr(module, "module") and isinstance(module.module, torch.nn.Module):
        module = module.module
    return module


def find_attention_layers(model_chunks: Sequence[torch.nn.Module]) -> list[AttentionLayer]:
    """Every megatron-core ``SelfAttention`` with a fused ``linear_qkv`` on this rank, in layer order."""
    from megatron.core.transformer.attention import SelfAttention

    found = []
    for chunk in model_chunks:
        for module in _unwrap(chunk).modules():
            if isinstance(module, SelfAttention):
                tp_size = torch.distributed.get_world_size(module.tp_group) if module.tp_group is not None else 1
                if module.config.num_query_groups < tp_size:
                    raise ValueError(
                        f"num_query_groups={module.config.num_query_groups} < TP={tp_size}: megatron replicates "
                        f"K/V heads across TP ranks in this layout, which the attention monitor does not support")
                tp_rank = torch.distributed.get_rank(module.tp_group) if module.tp_group is not None else 0
                found.append(AttentionLayer(
                    layer=module.layer_number - 1,  # megatron counts from 1, over all pipeline stages
                    qkv_weight=module.linear_qkv.weight,
                    num_heads=module.num_attention_heads_per_partition,
                    num_query_groups=module.num_query_groups_per_partition,
                    head_dim=module.hidden_size_per_attention_head,
                    head_offset=tp_rank * module.num_attention_heads_per_partition))
    return sorted(found, key=lambda spec: spec.layer)


def find_dense_linears(model_chunks: Sequence[torch.nn.Module]) -> dict:
    """``{"layer{L}/<name>": (weight shard, shard_dim)}`` for the dense linears of every transformer layer:
    attention output (RowParallel: split on dim 1) and MLP fc1 (ColumnParallel: dim 0) / fc2 (RowParallel: dim 1).
    MoE experts are left out: each expert-parallel rank holds different experts, so they are not one matrix."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.transformer_layer import TransformerLayer

    found = {}
    for chunk in model_chunks:
        for layer in _unwrap(chunk).modules():
            if not isinstance(layer, TransformerLayer):
                continue
            candidates = {"linear_proj": getattr(layer.self_attention, "linear_proj", None),
                          "linear_fc1": getattr(layer.mlp, "linear_fc1", None),
                          "linear_fc2": getattr(layer.mlp, "linear_fc2", None)}
            for name, module in candidates.items():
                if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                    dim = 0 if isinstance(module, ColumnParallelLinear) else 1
                    found[f"layer{layer.layer_number - 1}/{name}"] = (module.weight, dim)
    return dict(sorted(found.items()))


def find_routers(model_chunks: Sequence[torch.nn.Module]) -> list[tuple[int, torch.nn.Module]]:
    """``(layer index, TopKRouter)`` for every MoE layer on this rank."""
    from megatron.core.transformer.moe.router import TopKRouter

    routers = []
    for chunk in model_chunks:
        for module in _unwrap(chunk).modules():
            if isinstance(module, TopKRouter):
                routers.append((module.layer_number - 1, module))
    return sorted(routers, key=lambda item: item[0])


def _wrap_gating(router: torch.nn.Module, layer: int, monitor: RouterMonitor) -> None:
    """Capture the full router logits (before top-k) of every micro-batch: wrap this instance's ``gating``.

    ``TopKRouter.forward`` calls ``self.gating(input)`` and then routes on those logits; we pass them through
    unchanged. Idempotent: a router is wrapped once.
    """
    if getattr(router, "_mech_wrapped", False):
        return
    original = router.gating

    def gating(input, *args, **kwargs):
        logits = original(input, *args, **kwargs)
        monitor.record(layer, logits)
        return logits

    router.gating = gating
    router._mech_wrapped = True


# ------------------------------------------------------------------------------------------------ the adapter
class MegatronMech:
    """Monitors + detectors + sinks for one megatron-core training run (one instance per rank)."""

    def __init__(self, config: MechConfig, model_chunks: Sequence[torch.nn.Module], *, tp_group=None,
                 token_group=None, pp_group=None, logging_rank: bool = True, sinks=None,
                 printer: Callable[[str], None] = print):
        self.config = config
        self.logging_rank = logging_rank
        self.pp_group = pp_group
        self.printer = printer
        self.sinks = sinks
        self.registry = DetectorRegistry(rules=config.detector_rules())
        self.attention: Optional[AttentionMonitor] = None
        self.router: Optional[RouterMonitor] = None
        routers = find_routers(model_chunks)
        # One tiny all-reduce that every rank joins, so every rank takes the same branches below (and raises
        # the same clear error).
        any_routers = _any_rank(bool(routers))
        if config.monitors == ("auto",):  # resolve now that the model is known
            config.monitors = ("attention", "router") if any_routers else ("attention",)
        if "attention" in config.monitors:
            layers = find_attention_layers(model_chunks)
            self.attention = AttentionMonitor(layers, AttentionMonitorConfig(
                interval=config.interval, dw_scope=config.dw_scope, qk_terms=config.qk_terms,
                qk_method=config.qk_method,
                snapshot_device="cpu" if config.snapshot_device == "cpu" or not torch.cuda.is_available()
                else f"cuda:{torch.cuda.current_device()}",
                save_snapshots=config.checkpoint_snapshots), tp_group=tp_group,
                extra_linears=find_dense_linears(model_chunks) if config.all_linears else None)
        if "router" in config.monitors:
            if not any_routers:
                raise ValueError("--mech-monitors router was requested but the model has no MoE routers "
                                 "(use --num-experts, or --mech-monitors attention)")
            self.router = RouterMonitor([RouterLayer(layer, r.weight, r.topk) for layer, r in routers],
                                        token_group=token_group)
            for layer, r in routers:
                _wrap_gating(r, layer, self.router)
        self.last_alerts: list[Alert] = []
        self.alert_callbacks: list[Callable[[int, list], None]] = []  # user hooks: fn(step, alerts), every rank
        self.first_alert_step: Optional[int] = None
        # the training loss of every step since step 1, kept with the monitor state so that a resumed run's
        # summary covers the whole run
        self.losses: list[float] = []
        self.seconds: dict[str, float] = {}  # wall time per monitor part (attention, router, detectors, output)

    @classmethod
    def from_args(cls, args: argparse.Namespace, model_chunks, output_dir=None, tensorboard_dir=None, **kwargs):
        """Build from parsed flags, with megatron's process groups and the default sinks on the logging rank."""
        from megatron.core import parallel_state as ps

        config = MechConfig.from_args(args)
        sequence_parallel = bool(getattr(args, "sequence_parallel", False))
        token_group = (ps.get_tensor_and_data_parallel_group(with_context_parallel=True) if sequence_parallel
                       else ps.get_data_parallel_group(with_context_parallel=True))
        logging_rank = torch.distributed.get_rank() == torch.distributed.get_world_size() - 1
        sinks = None
        if logging_rank:
            sinks = build_sinks(config.output_dir or output_dir or "runs/mech", tensorboard_dir,
                                config.wandb_project, resume_step=kwargs.pop("resume_step", None))
        else:
            kwargs.pop("resume_step", None)
        return cls(config, model_chunks, tp_group=ps.get_tensor_model_parallel_group(), token_group=token_group,
                   pp_group=ps.get_pipeline_model_parallel_group()
                   if ps.get_pipeline_model_parallel_world_size() > 1 else None,
                   logging_rank=logging_rank, sinks=sinks, **kwargs)

    # -------------------------------------------------------------------------------------------- per step
    def is_evaluation_step(self, step: int) -> bool:
        return step % self.config.interval == 0

    def begin(self, step: int) -> None:
        """Call once before the first training step (after loading any state): takes the first snapshot."""
        if self.attention is not None and self.attention.snapshot_step is None and self.attention.should_observe(step):
            self.attention.observe(step)

    def before_step(self, step: int) -> None:
        """Call before the forward/backward of the step that will end with optimizer step number ``step``."""
        if self.router is not None:
            self.router.capturing = self.is_evaluation_step(step)

    def after_step(self, step: int, loss: float, lr: float, grad_norm: Optional[float], extra: Optional[dict] = None):
        """Call after ``optimizer.step()`` (step = number of optimizer steps taken). Returns this step's alerts."""
        self.losses.append(float(loss))
        metrics: dict[str, float] = {}
        details: dict[str, dict] = {}
        with self._timed("attention"):
            observed = self.attention.observe(step) if self.attention is not None else None
        if observed is not None:
            metrics.update(observed[0])
            details.update(observed[1])
        if not self.is_evaluation_step(step):
            return self._nonfinite_symptoms(step, loss, lr, grad_norm, extra)
        if self.router is not None:
            with self._timed("router"):
                observed = self.router.observe(step)
                self.router.capturing = False
            metrics.update(observed[0])
            details.update(observed[1])
        if self.pp_group is not None:  # each pipeline stage holds its own layers: merge so every rank sees all
            with self._timed("pipeline_gather"):
                gathered = [None] * torch.distributed.get_world_size(self.pp_group)
                torch.distributed.all_gather_object(gathered, (metrics, details), group=self.pp_group)
            for stage_metrics, stage_details in gathered:
                metrics.update(stage_metrics)
                details.update(stage_details)
        metrics["symptom/loss"] = float(loss)
        if grad_norm is not None:
            metrics["symptom/grad_norm"] = float(grad_norm)
        # Every rank runs the detectors on identical metrics, so every rank knows the alerts without a broadcast.
        with self._timed("detectors"):
            alerts = self.registry.update(step, metrics, details)
        self.last_alerts = alerts
        if self.logging_rank:
            with self._timed("output"):
                for line in alert_lines(alerts):  # one line per (family, layer), not per series
                    self.printer(f"[mech] ALERT step {step}: {line}")
                if self.sinks is not None:
                    from megatron_mech.records.sinks import make_record

                    scalars = {"loss": float(loss), "lr": float(lr),
                               "grad_norm": float(grad_norm) if grad_norm is not None else math.nan}
                    self.sinks.write(make_record(step, scalars, metrics, alerts, extra=extra))
        return alerts

    def _nonfinite_symptoms(self, step: int, loss: float, lr: float, grad_norm: Optional[float],
                            extra: Optional[dict]) -> list:
        """Between evaluations: a non-finite loss or grad norm is judged at once, not at the next evaluation.

        Both values are identical on every rank (the loss is averaged over data-parallel ranks and the grad
        norm is reduced over the whole model), so every rank fires the same alerts without a collective.
        """
        symptoms = {"symptom/loss": float(loss)}
        if grad_norm is not None:
            symptoms["symptom/grad_norm"] = float(grad_norm)
        if all(math.isfinite(v) for v in symptoms.values()):
            return []
        alerts = self.registry.update(step, symptoms)
        self.last_alerts = alerts
        if self.logging_rank and alerts:
            with self._timed("output"):
                for line in alert_lines(alerts):
                    self.printer(f"[mech] ALERT step {step}: {line}")
                if self.sinks is not None:
                    from megatron_mech.records.sinks import make_record

                    scalars = {"loss": float(loss), "lr": float(lr), "grad_norm": symptoms.get("symptom/grad_norm")}
                    self.sinks.write(make_record(step, scalars, {}, alerts, extra=extra))
        return alerts

    def alert_action(self, step: int, alerts: Sequence[Alert]) -> Optional[str]:
        """What the trainer should do after this step: None, "log", "checkpoint" or "stop".

        Acts on the run's *first* alert only. Whether anything fired is agreed with one tiny all-reduce on
        evaluation steps, so every rank takes the same branch (saving and stopping are collective) even if a
        rank's metrics differed in the last bit. Between evaluations only non-finite loss/grad-norm alerts
        exist, and those are identical on every rank (see ``_nonfinite_symptoms``): no collective is needed.
        User callbacks (``alert_callbacks``) run on every rank.
        """
        if not self.is_evaluation_step(step):
            fired = bool(alerts)
        else:
            fired = _any_rank(bool(alerts))
        if not fired:
            return None
        for callback in self.alert_callbacks:
            callback(step, list(alerts))
        if self.first_alert_step is not None:
            return "log"
        self.first_alert_step = step
        return self.config.on_alert

    def record_alert_checkpoint(self, step: int, directory, save_dir) -> None:
        """Write ``<save>/first_alert.json``: the alert step, its checkpoint, and the last checkpoint before it."""
        if not self.logging_rank:
            return
        import json

        earlier = sorted(int(p.name.split("_")[1]) for p in Path(save_dir).glob("iter_*") if p.is_dir()
                         and int(p.name.split("_")[1]) < step)
        record = {"step": step, "checkpoint": str(directory),
                  "last_checkpoint_before_alert": earlier[-1] if earlier else None,
                  "alerts": [a.to_dict() for a in self.last_alerts]}
        (Path(save_dir) / "first_alert.json").write_text(json.dumps(record, indent=1))
        self.printer(f"[mech] first alert at step {step}: checkpoint {directory}"
                     + (f"; roll back to iter_{earlier[-1]:07d} (before the alert)" if earlier else ""))

    @contextlib.contextmanager
    def _timed(self, part: str):
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[part] = self.seconds.get(part, 0.0) + time.perf_counter() - started

    @property
    def evaluation_seconds(self) -> float:
        """Wall time spent in the monitors on this rank so far: snapshots and evaluations, detectors, output, and
        router-logit capture inside the forward passes of evaluation steps (for overhead reporting)."""
        return sum(self.seconds.values()) + (self.router.capture_seconds if self.router is not None else 0.0)

    def close(self) -> None:
        if self.sinks is not None:
            self.sinks.close()

    # -------------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict:
        return {"version": 1, "first_alert_step": self.first_alert_step, "losses": list(self.losses),
                "attention": self.attention.state_dict() if self.attention is not None else None,
                "router": self.router.state_dict() if self.router is not None else None,
                "detectors": self.registry.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or state.get("version") != 1:
            raise ValueError(f"not a megatron-mech monitor state (version {getattr(state, 'get', lambda k: None)('version')})")
        if self.attention is not None and state.get("attention") is not None:
            self.attention.load_state_dict(state["attention"])
        if self.router is not None:
            self.router.load_state_dict(state.get("router"))
        self.registry.load_state_dict(state["detectors"])
        self.first_alert_step = state.get("first_alert_step")
        self.losses = [float(v) for v in state.get("losses", [])]


def _any_rank(flag: bool) -> bool:
    """True if ``flag`` holds on any rank (one tiny all-reduce; every rank must call it)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return flag
    t = torch.tensor([1.0 if flag else 0.0])
    if str(torch.distributed.get_backend()) == "nccl":
        t = t.cuda()
    torch.distributed.all_reduce(t)
    return bool(t.item() > 0)


def build_sinks(output_dir, tensorboard_dir=None, wandb_project=None, resume_step=None):
    """JSONL always (``<output_dir>/mech.jsonl``), TensorBoard and W&B when asked. Logging rank only."""
    from megatron_mech.records.sinks import JsonlSink, MultiSink, TensorBoardSink, WandbSink

    Path(output_dir).mkdir(parents=True, exist_ok=True)
    sinks = [JsonlSink(Path(output_dir) / "mech.jsonl", truncate_after_step=resume_step)]
    if tensorboard_dir:
        sinks.append(TensorBoardSink(tensorboard_dir))
    if wandb_project:
        sinks.append(WandbSink(project=wandb_project))
    return MultiSink(sinks)
