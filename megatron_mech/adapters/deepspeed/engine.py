"""The DeepSpeed adapter: one ``DeepSpeedEngine`` translated onto the hook's lifecycle.

The monitors, detectors, MoLS controller, alert policy and records belong to :class:`megatron_mech.hook.MechHook`;
this module finds what the hook needs in a DeepSpeed engine (a :class:`~megatron_mech.model_view.ModelView`:
the HF attention layers, the routers, the groups), installs the MoLS backend, and calls the hook at the right
points of a DeepSpeed step. Every rank builds it (after ``deepspeed.initialize``) and calls it at the same
points of every step; the monitors issue their collectives at the same steps, in the same order, on every
rank, and a rank with nothing to add (no routed tokens) still joins. Global rank 0 writes the records.

    engine, *_ = deepspeed.initialize(model=model, model_parameters=param_groups(model), config=cfg)
    mech = DeepSpeedMech.from_engine(engine, train_steps=T)   # reads and validates cfg["mech"]
    load_checkpoint(engine, mech, ckpt_dir)                    # optional resume (weights-only, see there)
    for batch in data:
        mech.before_step()
        for micro in split(batch):                             # gradient accumulation: engine.step per micro-batch
            loss = engine(micro); engine.backward(loss)
            mech.after_backward()                              # MoLS statistics, before engine.step()
            engine.step()
        action = mech.after_step(loss)                         # after the optimizer step
        if action is not Action.CONTINUE: save_checkpoint(engine, mech, ckpt_dir)
        if action is Action.STOP: break

Step numbering: the hook's ``step`` is the 1-based number of the optimizer step, ``engine.global_steps`` after it.

State: the detectors (fed identical, reduced metrics) and the MoLS controller (fed all-reduced statistics) are
the same on every rank, but the attention snapshots are not: with the data-parallel split each rank holds the
snapshots of its own share of the layers. So :func:`save_checkpoint` writes the hook's state per rank, next to
DeepSpeed's files (``<save_dir>/<tag>/mech_rank00000.pt``, loaded with ``weights_only=True``), and puts only a
small marker (world size, file pattern) in ``engine.save_checkpoint(client_state=...)``. The MoLS scheduler
wrapper's state is in DeepSpeed's own ``lr_scheduler`` entry.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
from pathlib import Path
from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist

from megatron_mech.adapters.deepspeed.attention import (
    find_hf_attention,
    hf_attention_logit_captures,
    master_weight_reader,
)
from megatron_mech.adapters.deepspeed.ds_config_section import DeepSpeedOptions, parse_section, read_section
from megatron_mech.adapters.deepspeed.mols_backend import DeepSpeedMoLS
from megatron_mech.adapters.deepspeed.router_capture import find_gates, gate_capture, token_group_of
from megatron_mech.adapters.deepspeed.safe_load import weights_only_loads
from megatron_mech.config import MechConfig
from megatron_mech.hook import Action, Extension, MechHook
from megatron_mech.hook.async_evaluation import destroy_groups
from megatron_mech.model_view import MASTER_WEIGHTS, ModelView, RouterView, model_weights_words
from megatron_mech.records.run_directory import MAX_SMALL_FILE_BYTES, SUMMARY, write_run_id
from megatron_mech.records.run_summary import RunSummary, write_run_summary
from megatron_mech.records.safe_files import open_regular, read_small_file, refuse_symlink, write_file_atomically

__all__ = ["CLIENT_STATE_KEY", "TAG_PREFIX", "DeepSpeedMech", "load_checkpoint", "save_checkpoint"]

logger = logging.getLogger(__name__)
CLIENT_STATE_KEY = "megatron_mech"
#: DeepSpeed's default checkpoint tag is this prefix and the number of optimizer steps taken
TAG_PREFIX = "global_step"

def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _solo_group():
    """A process group holding only this rank: HF models under DeepSpeed keep whole attention weights on every
    rank (no tensor parallelism), so the attention monitor needs no communication. A collective: every rank takes
    part in creating all of them. Destroyed by :meth:`DeepSpeedMech.close`."""
    if not _distributed():
        return None
    group, _ = dist.new_subgroups(group_size=1)
    return group


class DeepSpeedMech:
    """The hook plus what DeepSpeed needs around it. Build with :meth:`from_engine`."""

    def __init__(self, engine, config: MechConfig, options: DeepSpeedOptions = DeepSpeedOptions(), *,  # noqa: B008 (frozen)
                 train_steps: Optional[int] = None, lr_warmup_steps: Optional[int] = None,
                 extensions: Iterable[Extension] = ()):
        self.engine, self.config, self.options = engine, config, options
        self.logging_rank = (dist.get_rank() if _distributed() else 0) == 0
        self.token_group = token_group_of(engine) if _distributed() else None
        model = engine.module
        self._solo_group = _solo_group()
        self.hook = MechHook(config, train_steps=train_steps, lr_warmup_steps=lr_warmup_steps, extensions=extensions)
        requested = self.hook.requested_families
        self.attention_sources = find_hf_attention(model, options.attention_layout) if "attention" in requested else []
        self.gates = find_gates(model) if "router" in requested else []
        monitor = getattr(engine, "monitor", None)
        use_monitor = options.engine_monitor and monitor is not None and getattr(monitor, "enabled", False)
        self._engine_monitor = monitor if use_monitor else None  # also gets the records (logging rank)
        for extension in self.hook.extensions:  # e.g. the studies' emulated attention, told the step by the hook
            extension.prepare_model(model)
        # the optimizer's float32 master weights (bf16/fp16 training) or the module's (None): see read_weights
        self.read_master = master_weight_reader(engine) if config.monitors.weights == "master" else None
        for gate in self.gates if self.read_master is not None else ():
            gate.use_master(self.read_master)
        read = [p for a in self.attention_sources for p in a.params] + [g.param for g in self.gates]
        self.view = ModelView(
            weights=(MASTER_WEIGHTS if self.read_master is not None
                     else model_weights_words({p.dtype for p in read})),
            attention_layers=[a.spec() for a in self.attention_sources],
            attention_logit_capture=hf_attention_logit_captures(self.attention_sources),
            routers=[RouterView(g.layer, g.weight, g.topk, gate_capture(g)) for g in self.gates],
            # dp_group: every rank of the (sequence-)data-parallel group holds the same dense weights (ZeRO 0-2
            # replicate them; ZeRO 3 gathers them for the monitors), the token group itself.
            tp_group=self._solo_group, token_group=self.token_group, dp_group=self.token_group,
            logging_rank=self.logging_rank,
            mols=lambda core, log=None: DeepSpeedMoLS(core, engine, self.token_group,
                                                      log if self.logging_rank else (lambda *_: None)))
        self.mols: Optional[DeepSpeedMoLS] = None
        if config.mols.enabled:
            if not train_steps:
                raise ValueError("mech.mols is enabled: pass train_steps=<optimizer steps of the run> to "
                                 "DeepSpeedMech.from_engine (it sizes and checks the estimation window)")
            self.hook.optimizer_overrides(self.view)  # builds the backend (and checks the window fits)
            self.mols = self.hook.mols
        self.hook.attach_optimizer(engine.optimizer)  # MoLS: installs the scheduler wrapper
        self._is_setup = False
        self._step_base_lr = math.nan
        self._skipped_so_far = int(getattr(engine, "skipped_steps", 0) or 0)
        self.last_action = Action.CONTINUE
        self.summary_written: Optional[bool] = None
        """Whether :meth:`close` wrote ``summary.json`` (None: it did not try, on this rank or without a directory)."""

    @classmethod
    def from_engine(cls, engine, config: Any = None, **kwargs) -> DeepSpeedMech:
        """Build from the engine's own config (its ``"mech"`` section) or from ``config`` (a section dict, or a
        ``(MechConfig, DeepSpeedOptions)`` pair). Raises ``ValueError`` naming any unknown or bad ``mech`` key,
        before any training step. ``kwargs``: ``train_steps`` (needed by MoLS to size its window),
        ``lr_warmup_steps`` (MoLS ramps its multipliers in until then), ``extensions`` (hook extensions; their
        ``prepare_model`` gets the engine's module)."""
        if isinstance(config, tuple):
            mech_config, options = config
        else:
            mech_config, options = parse_section(read_section(engine) if config is None else config)
        return cls(engine, mech_config, options, **kwargs)

    # -------------------------------------------------------------------------------------------- per step
    @property
    def step(self) -> int:
        """Optimizer steps taken so far (``engine.global_steps``)."""
        return int(self.engine.global_steps)

    def is_evaluation_step(self, step: int) -> bool:
        """:meth:`MechHook.is_evaluation_step <megatron_mech.hook.MechHook.is_evaluation_step>`."""
        return self.hook.is_evaluation_step(step)

    def _refresh(self, step: int) -> None:
        """Copy the live weights into what the monitors read (ZeRO-3: gathers, same order on every rank)."""
        if self.hook.monitor("attention") is not None and self.is_evaluation_step(step):
            with self.hook.timed("attention"):
                for source in self.attention_sources:
                    source.refresh(self.read_master)
        if self.hook.monitor("router") is not None and self.is_evaluation_step(step):
            with self.hook.timed("router"):
                for gate in self.gates:
                    gate.refresh()

    def _setup(self) -> None:
        start = self.step
        if self.logging_rank:  # opened now, after a checkpoint load: mech.jsonl is cut back to the loaded step
            from megatron_mech.records.sinks import DeepSpeedMonitorSink

            extra = ([DeepSpeedMonitorSink(self._engine_monitor, level=self.hook.config.output.writer_level)]
                     if self._engine_monitor is not None else [])
            self.hook.open_sinks(start, extra=extra)
        self._refresh_all()
        self.hook.setup(self.view, self.engine.optimizer, start_step=start)
        self._is_setup = True

    def _refresh_all(self) -> None:
        for source in self.attention_sources:
            source.refresh(self.read_master)
        for gate in self.gates:
            gate.refresh()

    def before_step(self) -> None:
        """Before the first forward of optimizer step ``self.step + 1``."""
        if not self._is_setup:
            self._setup()
        # the record's lr: the base lr this step's update runs at (the scheduler already set it), as MoLS's
        # multipliers in the record are this step's; read before an LR fault scales the groups
        self._step_base_lr = (self.mols.scheduler.base_lrs[0] if self.mols is not None
                              else float(self.engine.get_lr()[0]))
        self.hook.before_step(self.step + 1)
        if self.mols is not None:
            self.mols.arm()

    def after_backward(self) -> None:
        """After every ``engine.backward``; at the accumulation boundary, before ``engine.step()``, MoLS reads the
        reduced gradients (window steps only)."""
        if self.mols is not None:
            self.mols.after_backward(self.engine.is_gradient_accumulation_boundary())

    def after_step(self, loss, extra: Optional[dict] = None) -> Action:
        """After ``engine.step()`` at the accumulation boundary. ``loss``: this rank's loss, a tensor (its mean) or
        a number (averaged over the data-parallel ranks here on evaluation steps, so every rank feeds the detectors
        the same value). Returns the hook's :class:`~megatron_mech.hook.Action` (identical on every rank).

        On a step where nothing evaluates, the loss and DeepSpeed's grad norm are handed to the hook as they are:
        no host synchronisation and no collective; the hook reads them back at its next evaluation."""
        step = self.step
        if self.is_evaluation_step(step) and _distributed():
            loss = self._data_parallel_mean(loss)
        self._refresh(step)
        grad_norm = self.engine.get_global_grad_norm()  # a tensor, a float (inf: overflow) or None
        # DeepSpeed counts the steps its optimizer skipped (non-finite gradients, an fp16 overflow), silently
        skipped_so_far = int(getattr(self.engine, "skipped_steps", 0) or 0)
        skipped = skipped_so_far > self._skipped_so_far
        self._skipped_so_far = skipped_so_far
        self.last_action = self.hook.after_optimizer_step(step, loss=loss, grad_norm=grad_norm,
                                                          lr=self._step_base_lr, extra=extra, skipped=skipped)
        return self.last_action

    def _data_parallel_mean(self, loss) -> torch.Tensor:
        """The mean of the ranks' losses over the token group, in float64, as a one-element tensor (one
        all-reduce; every rank calls it on the same steps)."""
        from megatron_mech.core.sharded import collective_device

        device = collective_device(self.token_group)
        if isinstance(loss, torch.Tensor):
            total = loss.detach().float().mean().to(device=device, dtype=torch.float64).reshape(1)
        else:
            total = torch.tensor([float(loss)], dtype=torch.float64, device=device)
        dist.all_reduce(total, group=self.token_group)
        return total / dist.get_world_size(self.token_group)

    # -------------------------------------------------------------------------------------------- reporting
    @property
    def last_alerts(self):
        return self.hook.last_alerts

    @property
    def monitor_seconds(self) -> float:
        """Wall time this rank spent in the monitors: snapshots and evaluations (with ZeRO-3 gathers), router
        capture and reduction, detectors and output. MoLS's statistics are apart (``hook.mols_seconds``)."""
        return self.hook.evaluation_seconds

    # -------------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict:
        return self.hook.state_dict()

    def load_state_dict(self, state: dict, source: Optional[str] = None) -> None:
        if self._is_setup:
            raise RuntimeError("load the checkpoint before the first before_step(): the monitors resume from it")
        self.hook.load_state_dict(state, source=source)

    def close(self, *, summary_dir=None, step_seconds: Optional[Iterable[float]] = None,
              **trainer_fields: Any) -> RunSummary:
        """Flush and close the records (the hook's :meth:`~megatron_mech.hook.MechHook.close`), remove the router
        hooks and destroy the process groups this object created, so none is left alive at the interpreter's exit.
        The script's own groups are its own: end it with ``dist.destroy_process_group()`` (the guide's example).

        Returns the run's :class:`~megatron_mech.records.run_summary.RunSummary` (the ``summary.json`` schema, see
        ``docs/outputs.md``) on every rank, with ``step_seconds`` (each step's wall time, when the script times
        its steps) and the script's own ``trainer_fields`` (JSON values). The logging rank writes it to
        ``<summary_dir>/summary.json`` (default: the ``"mech"`` section's ``output.dir``; nothing is written when
        neither is set); :attr:`summary_written` then says whether the write succeeded."""
        for g in self.gates:
            handle = getattr(g, "handle", None)
            if handle is not None:
                handle.remove()
        if self.mols is not None:
            self.mols.close()
        self.hook.close()
        destroy_groups([self._solo_group])
        self._solo_group = None
        summary = self.hook.run_summary(step_seconds=step_seconds, **trainer_fields)
        summary_dir = summary_dir or self.config.output.dir
        if self.logging_rank and summary_dir is not None:
            self.summary_written = write_run_summary(Path(summary_dir) / SUMMARY, summary, indent=1)
        return summary


def _rank_and_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if _distributed() else (0, 1)


def _rank_state_file(tag_dir, rank: int):
    return Path(tag_dir) / f"mech_rank{rank:05d}.pt"


def _confined_tag(load_dir, tag, universal: bool) -> tuple[Optional[str], Optional[Path]]:
    """The tag to load from ``load_dir`` and the tracker file it was read from (None for a given tag).

    Without a tag DeepSpeed reads ``<load_dir>/latest`` (``latest_universal``) and joins whatever it holds to
    ``load_dir``: ``../../other/ckpt/global_step4`` or an absolute path loads another run's checkpoint, without a
    word. Here the tag is read the same way and must name a directory inside ``load_dir`` once resolved (symbolic
    links followed), else ``ValueError`` names the tracker file and the tag. A missing tracker is left to
    DeepSpeed (nothing to load)."""
    source = None
    if tag is None:
        source = Path(load_dir) / ("latest_universal" if universal else "latest")
        if not os.path.lexists(source):
            return None, source
        tag = read_small_file(source, MAX_SMALL_FILE_BYTES, "a DeepSpeed tracker").decode("utf-8", "replace").strip()
    tag = str(tag)
    where = f"DeepSpeed tracker {source} names tag {tag!r}" if source is not None else f"tag {tag!r}"
    if not tag or "\0" in tag:
        raise ValueError(f"{where}, which is not a checkpoint directory name")
    root = Path(load_dir).resolve()
    target = (Path(load_dir) / tag).resolve()
    if root not in target.parents:
        raise ValueError(f"{where}, which resolves to {target}, outside the checkpoint directory {load_dir} "
                         f"({root}): a tag names a checkpoint inside it, so another directory's checkpoint is "
                         f"not loaded; pass that directory itself to load it")
    return tag, source


def save_checkpoint(engine, mech: DeepSpeedMech, save_dir, tag=None, client_state: Optional[dict] = None, *,
                    run_id: Optional[str] = None, **kwargs):
    """``engine.save_checkpoint`` plus the hook's per-rank state file (every rank calls it); tells the hook
    (``first_alert.json`` next to the alert's checkpoint). ``run_id``: the run's id, written by rank 0 into the tag
    directory (``run_id.txt``) so that a resume can tell whether an output directory holds this run's records."""
    rank, world = _rank_and_world()
    tag = str(tag if tag is not None else f"{TAG_PREFIX}{engine.global_steps}")
    tag_dir = Path(save_dir) / tag
    # DeepSpeed writes through links: the "latest" file, and every file of a tag directory that links elsewhere
    refuse_symlink(Path(save_dir) / "latest")
    refuse_symlink(tag_dir)
    state = dict(client_state or {})
    state[CLIENT_STATE_KEY] = {"per_rank_files": True, "world_size": world}
    if run_id is not None and rank == 0:  # before DeepSpeed moves "latest" to this tag: the newest always has it
        tag_dir.mkdir(parents=True, exist_ok=True)
        write_run_id(tag_dir, run_id)
    result = engine.save_checkpoint(save_dir, tag=tag, client_state=state, **kwargs)
    tag_dir.mkdir(parents=True, exist_ok=True)
    state = mech.state_dict()  # atomic, never through a link; a full disk leaves no partial file
    write_file_atomically(_rank_state_file(tag_dir, rank), lambda f: torch.save(state, f))
    mech.hook.checkpoint_saved(mech.step, tag_dir)
    return result


def load_checkpoint(engine, mech: DeepSpeedMech, load_dir, tag=None, *, trust_checkpoint: bool = False, **kwargs):
    """``engine.load_checkpoint`` and restore the hook from this rank's state file (before the first step); returns
    DeepSpeed's ``(load_path, client_state)`` without our entry. Raises ``ValueError`` when nothing is found, or
    when the checkpoint was written by a different number of ranks.

    DeepSpeed's files are read weights-only, admitting only the types DeepSpeed's own checkpoints hold
    (:mod:`megatron_mech.adapters.deepspeed.safe_load`); a file needing anything else raises ``UnsafeCheckpointError``
    (a ``ValueError``) naming the file and the type, and nothing of it runs. ``trust_checkpoint=True`` hands
    the files to DeepSpeed's own loader, which unpickles anything: only for checkpoints you trust.

    The tag (given, or read from ``load_dir``'s ``latest`` file) must name a directory inside ``load_dir``
    (``ValueError`` naming the file and the tag otherwise, trusted or not); the directory loaded is logged."""
    tag, source = _confined_tag(load_dir, tag, engine.load_universal_checkpoint())
    loads = contextlib.nullcontext() if trust_checkpoint else weights_only_loads(engine)
    with loads:
        path, client_state = engine.load_checkpoint(load_dir, tag=tag, **kwargs)
    if path is None:
        raise ValueError(f"no DeepSpeed checkpoint found in {load_dir} (tag {tag})")
    if _rank_and_world()[0] == 0:
        logger.info("loaded DeepSpeed checkpoint %s (tag %r%s)", Path(load_dir) / tag, tag,
                    f", from {source}" if source is not None else "")
    client_state = dict(client_state or {})
    marker = client_state.pop(CLIENT_STATE_KEY, None)
    if not isinstance(marker, dict) or not marker.get("per_rank_files"):
        raise ValueError(f"checkpoint {path} has no {CLIENT_STATE_KEY!r} client state (saved without "
                         f"megatron_mech.adapters.deepspeed.engine.save_checkpoint?)")
    rank, world = _rank_and_world()
    if marker.get("world_size") != world:
        raise ValueError(f"checkpoint {path} holds megatron-mech state for {marker.get('world_size')} ranks; this "
                         f"run has {world}: resume with the same number of ranks")
    state_file = _rank_state_file(Path(path).parent, rank)
    if not os.path.lexists(state_file):
        raise ValueError(f"checkpoint {path}: missing megatron-mech state file {state_file}")
    with open_regular(state_file) as f:  # never blocks on a FIFO planted as the state file
        state = torch.load(f, map_location="cpu", weights_only=True)
    mech.load_state_dict(state, source=f"checkpoint {path}")
    return path, client_state
