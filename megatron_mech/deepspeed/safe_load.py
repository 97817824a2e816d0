"""Loading DeepSpeed checkpoints without running code from them.

DeepSpeed's checkpoint engines unpickle every checkpoint file with ``torch.load(weights_only=False)``: a planted
``mp_rank_00_model_states.pt`` or ``*_optim_states.pt`` runs whatever its pickle says (``open``, ``os.system``)
the moment it is loaded. :func:`weights_only_loads` replaces the engine's checkpoint loader, for the duration of a
load, by ``torch.load(weights_only=True)`` that admits, besides tensors and plain containers, only the few
DeepSpeed types its own checkpoints hold (:data:`DEEPSPEED_CHECKPOINT_GLOBALS`, found by saving real ZeRO 0–3
checkpoints in fp32 and bf16 and listing their globals with ``torch.serialization.get_unsafe_globals_in_checkpoint``).
Anything else is refused with :class:`UnsafeCheckpointError`, naming the file and the global, before any of it
is built.

Only loads that go through the engine's checkpoint engine are covered: model and optimizer states, MoE expert
files and pipeline layer files. DeepSpeed's universal checkpoints are read with ``torch.load`` elsewhere, so they
are refused here unless the caller trusts the checkpoint.
"""
from __future__ import annotations

import contextlib
import importlib
import pickle
from typing import Iterator

import torch

__all__ = ["DEEPSPEED_CHECKPOINT_GLOBALS", "UnsafeCheckpointError", "weights_only_loads"]

DEEPSPEED_CHECKPOINT_GLOBALS = (
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"),           # optim_states: "zero_stage"
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),         # optim_states: the static loss scaler
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),  # optim_states: fp16 with dynamic loss scaling
    ("deepspeed.utils.tensor_fragment", "fragment_address"),      # optim_states (ZeRO 1/2): param_slice_mappings
)
"""``(module, name)`` of every non-torch type DeepSpeed 0.19 pickles into its checkpoint files."""

# The checkpoint engines whose ``load(path, map_location)`` is a plain ``torch.load`` of a file ``torch.save`` wrote.
_FILE_ENGINES = ("TorchCheckpointEngine", "FastCheckpointEngine", "DecoupledCheckpointEngine")
_TRUST_HINT = "pass trust_checkpoint=True to load_checkpoint (deepspeed_train.py: --trust-checkpoint) only for a " \
              "checkpoint you trust"


class UnsafeCheckpointError(ValueError):
    """A checkpoint file needs a type outside the allow-list to be unpickled (and so could run code)."""


def _allowed_globals() -> list:
    found = []
    for module_name, name in DEEPSPEED_CHECKPOINT_GLOBALS:
        try:
            found.append(getattr(importlib.import_module(module_name), name))
        except (ImportError, AttributeError):  # another DeepSpeed version: a type it no longer has is not needed
            continue
    return found


def _offending_globals(path: str, error: Exception) -> str:
    """The globals of ``path`` outside the allow-list, for the error message."""
    allowed = {f"{m}.{n}" for m, n in DEEPSPEED_CHECKPOINT_GLOBALS}
    try:
        names = [g for g in torch.serialization.get_unsafe_globals_in_checkpoint(path) if g not in allowed]
    except Exception:  # not a zip checkpoint (legacy format), or unreadable: torch's own message names the global
        names = []
    return ", ".join(names) if names else str(error).strip().splitlines()[0]


def _weights_only_load(path: str, map_location=None):
    with torch.serialization.safe_globals(_allowed_globals()):
        try:
            return torch.load(path, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as exc:
            raise UnsafeCheckpointError(
                f"refusing to load checkpoint file {path}: it needs {_offending_globals(path, exc)}, which DeepSpeed "
                f"checkpoints do not hold, and unpickling it could run code; {_TRUST_HINT}") from None


@contextlib.contextmanager
def weights_only_loads(engine) -> Iterator[None]:
    """While inside, ``engine``'s checkpoint engine loads files weights-only with the DeepSpeed allow-list. Raises
    ``ValueError`` up front for what cannot be covered: universal checkpoints, or a checkpoint engine that does
    not load plain ``torch.save`` files."""
    if engine.load_universal_checkpoint():
        raise ValueError(f"the DeepSpeed config loads a universal checkpoint, which DeepSpeed unpickles without "
                         f"restriction outside its checkpoint engine; {_TRUST_HINT}")
    checkpoint_engine = engine.checkpoint_engine
    kind = type(checkpoint_engine).__name__
    if kind not in _FILE_ENGINES:
        raise ValueError(f"DeepSpeed checkpoint engine {kind} cannot be restricted to weights-only loading "
                         f"(known: {', '.join(_FILE_ENGINES)}); {_TRUST_HINT}")
    shadowed = checkpoint_engine.__dict__.get("load")
    checkpoint_engine.load = _weights_only_load  # an instance attribute: this engine only, undone below
    try:
        yield
    finally:
        if shadowed is None:
            del checkpoint_engine.load
        else:
            checkpoint_engine.load = shadowed
