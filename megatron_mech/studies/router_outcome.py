"""Ground truth for router faults, independent of the monitors: what the routers actually did, step by step.

:class:`RoutingRecorder` (a hook extension, ``--mech-record-routing DIR``) counts, for every training step, how many
of the logging rank's tokens each MoE layer sent to each expert — read off the router's own routing decision (the
``routing_map`` its ``forward`` returns, through a forward hook), not off its logits as the router monitor is — and
writes one line per step to ``DIR/routing.jsonl``::

    {"step": 412, "counts": {"0": [311, 402, 180, 131], "1": [...], ...}}   # layer → top-k assignments per expert

:func:`router_collapse_step` reads that file and says whether, and from which step, routing collapsed:

**Routing collapse**: some expert of some MoE layer receives less than :data:`STARVED_SHARE` of its layer's top-k
assignments (a uniform router gives each of E experts 1/E; with 4 experts top-2, 25%) for :data:`STARVED_HOLD`
consecutive steps. The collapse step is the first step of that stretch (the step the expert went dead). Both
levels are absolute and were fixed on the tuning seeds (``benchmarks/results/router_collapse.md``).
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, NamedTuple, Optional, Sequence

import torch

from megatron_mech.hook import Extension
from megatron_mech.options import add_section_flags, file_path, option, section_from_flags
from megatron_mech.records.safe_files import open_no_follow, open_regular, refuse_unsafe_file
from megatron_mech.studies.outcomes import first_held_step

__all__ = ["ROUTING_FILE", "STARVED_HOLD", "STARVED_SHARE", "Collapse", "RoutingRecordConfig", "RoutingRecorder",
           "collapse_step", "find_collapse", "read_routing_counts", "router_collapse_step"]

logger = logging.getLogger(__name__)

ROUTING_FILE = "routing.jsonl"
STARVED_SHARE = 0.02
"""An expert is starved in a step when it gets less than this share of its layer's top-k assignments."""
STARVED_HOLD = 20
"""Consecutive starved steps of one expert that make a collapse (not a passing dip)."""


@dataclass
class RoutingRecordConfig:
    """The recorder's one setting."""

    dir: Optional[str] = option(None, "studies: write the per-step expert assignment counts of the logging rank's "
                                      "tokens, per MoE layer, to DIR/" + ROUTING_FILE + " (ground truth for router "
                                      "faults; read by megatron_mech.studies.router_outcome)",
                                flag="--mech-record-routing", type=file_path)


class RoutingRecorder(Extension):
    """Per-step top-k assignment counts per MoE layer and expert, from the routers' own routing decisions."""

    name = "routing_record"

    def __init__(self, out_dir):
        self.path = Path(out_dir) / ROUTING_FILE
        self.step: Optional[int] = None
        self.counts: dict = {}         # layer → int64 tensor [E] of this step's assignments
        self._layers: dict = {}        # id(router weight) → layer index
        self._handle = None
        self._file = None

    @classmethod
    def add_arguments(cls, parser) -> None:
        add_section_flags(parser.add_argument_group("megatron-mech routing record (studies)"), RoutingRecordConfig)

    @classmethod
    def from_args(cls, args) -> Optional[RoutingRecorder]:
        config = section_from_flags(RoutingRecordConfig, args)
        return cls(config.dir) if config.dir else None

    def describe(self) -> str:
        return f"recording per-step expert assignment counts to {self.path}"

    def setup(self, hook, view, optimizer=None) -> None:
        if not view.logging_rank or not view.routers:
            return
        self._layers = {id(router.weight): router.layer for router in view.routers}
        # A global forward hook filtered to this model's routers (by their weight): megatron-core builds the
        # router inside MoELayer, outside any layer spec an extension could change.
        self._handle = torch.nn.modules.module.register_module_forward_hook(self._observe)

    def _observe(self, module, inputs, output) -> None:
        layer = self._layers.get(id(getattr(module, "weight", None)))
        if layer is None or not isinstance(output, tuple) or len(output) != 2:
            return
        # training forwards only: not evaluation, not the second forward of activation recompute
        if not (module.training and torch.is_grad_enabled()) or torch._C._current_graph_task_id() != -1:
            return
        routing_map = output[1].detach().reshape(-1, output[1].shape[-1])
        counts = routing_map.sum(dim=0, dtype=torch.int64)  # summed where it is; copied to the host once a step
        self.counts[layer] = self.counts[layer] + counts if layer in self.counts else counts

    def before_step(self, step: int) -> None:
        self.step = int(step)
        self.counts = {}

    def after_optimizer_step(self, step: int, *, loss: float, grad_norm: Optional[float], lr: float) -> None:
        if self._handle is None or not self.counts:
            return
        if self._file is None:
            self._file = self._open(step)
        record = {"step": int(step), "counts": {str(k): v.tolist() for k, v in sorted(self.counts.items())}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def _open(self, first_step: int):
        """The record file, with the lines of steps this process is about to write again dropped (a resumed
        run rewrites them; a fresh run starts an empty file)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        refuse_unsafe_file(self.path)  # a link, a FIFO: refused by name before anything is read or written
        kept = []
        if os.path.lexists(self.path):
            with open_regular(self.path, "r") as f:
                kept = [line.rstrip("\n") for line in f if line.strip() and json.loads(line)["step"] < first_step]
        handle = open_no_follow(self.path, "w")  # never through a link
        handle.write("".join(line + "\n" for line in kept))
        return handle

    def close(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        if self._file is not None:
            self._file.close()
            self._file = None


def read_routing_counts(run_dir) -> dict:
    """``{step: {layer: [assignments per expert]}}`` from ``run_dir/routing.jsonl`` (FileNotFoundError naming
    the file and the flag when the run did not record)."""
    path = Path(run_dir) / ROUTING_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path}: no routing record (train with --mech-record-routing {run_dir})")
    steps = {}
    with open_regular(path, "r") as f:
        lines = f.read().splitlines()
    for line in lines:
        if line.strip():
            record = json.loads(line)
            steps[int(record["step"])] = {int(layer): list(c) for layer, c in record["counts"].items()}
    return steps


class Collapse(NamedTuple):
    """Where routing collapsed: the first starved step, and the layer and expert that starved."""

    step: int
    layer: int
    expert: int


def find_collapse(counts: Mapping[int, Mapping[int, Sequence[int]]], share: float = STARVED_SHARE,
                  hold: int = STARVED_HOLD) -> Optional[Collapse]:
    """The earliest stretch of ``hold`` consecutive recorded steps in which one expert of one layer gets less than
    ``share`` of its layer's assignments, as its first step, layer and expert; ``None`` if there is none.

    ``counts``: ``{step: {layer: [assignments per expert]}}``. A step missing from the record breaks a stretch.
    Every stretch needs the same ``hold``, so the first to complete is the one that started first (ties: the
    lowest layer, then expert). The stretch is counted by :func:`megatron_mech.studies.outcomes.first_held_step`."""
    if hold < 1 or not 0 < share < 1:
        raise ValueError(f"collapse_step: hold must be >= 1 and 0 < share < 1, got hold={hold}, share={share}")
    steps = sorted(counts)
    experts = sorted({(layer, expert) for step in steps for layer, per_expert in counts[step].items()
                      for expert in range(len(per_expert))})
    found = []
    for layer, expert in experts:
        starved = []
        for step in steps:  # a step whose record lacks the layer breaks the stretch, like a missing step
            per_expert = counts[step].get(layer, ())
            total = sum(per_expert)
            starved.append(expert < len(per_expert) and total > 0 and per_expert[expert] < share * total)
        start = first_held_step(steps, starved, hold, max_step_gap=1)
        if start is not None:
            found.append(Collapse(start, layer, expert))
    return min(found, default=None)


def collapse_step(counts: Mapping[int, Mapping[int, Sequence[int]]], share: float = STARVED_SHARE,
                  hold: int = STARVED_HOLD) -> Optional[int]:
    """The step of :func:`find_collapse` (``None``: routing did not collapse)."""
    found = find_collapse(counts, share, hold)
    return None if found is None else found.step


def router_collapse_step(run_dir, share: float = STARVED_SHARE, hold: int = STARVED_HOLD) -> Optional[int]:
    """:func:`collapse_step` of a run's routing record (``run_dir/routing.jsonl``)."""
    return collapse_step(read_routing_counts(run_dir), share, hold)
