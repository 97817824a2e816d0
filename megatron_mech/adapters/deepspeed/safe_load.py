"""Loading DeepSpeed checkpoints without running code from them.

DeepSpeed's checkpoint engines unpickle every checkpoint file with ``torch.load(weights_only=False)``: a planted
``mp_rank_00_model_states.pt`` or ``*_optim_states.pt`` runs whatever its pickle says (``open``, ``os.system``)
the moment it is loaded. :func:`weights_only_loads` replaces the engine's checkpoint loader, for the duration of a
load, by ``torch.load(weights_only=True)`` that admits, besides tensors and plain containers, only the few
DeepSpeed types its own checkpoints hold (:data:`DEEPSPEED_CHECKPOINT_GLOBALS`, found by saving real ZeRO 0–3
checkpoints in fp32 and bf16 and listing their globals with ``torch.serialization.get_unsafe_globals_in_checkpoint``).
Anything else is refused with :class:`UnsafeCheckpointError`, naming the file and the global, before any of it
is built.

The allowed types themselves take whatever the pickle gives them: a ``LossScaler`` with ``cur_scale=nan``, a
``fragment_address`` of strings, ``ZeroStageEnum(99)`` (a raw ``ValueError``), wrong constructor arguments (a raw
``TypeError``), or a state written into a shared enum member. So ``ZeroStageEnum`` is reached only through
:func:`_zero_stage`, which admits the stages DeepSpeed defines and nothing can be written into, and every
``LossScaler``, ``DynamicLossScaler`` and ``fragment_address`` the file built is checked (exactly DeepSpeed's
attributes, finite positive scales, counts in range) before DeepSpeed sees it; any failure is a
:class:`DamagedCheckpointError` naming the file.

Only loads that go through the engine's checkpoint engine are covered: model and optimizer states, MoE expert
files and pipeline layer files. DeepSpeed's universal checkpoints are read with ``torch.load`` elsewhere, so they
are refused here unless the caller trusts the checkpoint.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import math
import pickle
from typing import Any, Callable, Iterator

import torch

__all__ = ["DEEPSPEED_CHECKPOINT_GLOBALS", "DamagedCheckpointError", "UnsafeCheckpointError", "weights_only_loads"]

DEEPSPEED_CHECKPOINT_GLOBALS = (
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"),           # optim_states: "zero_stage"
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),         # optim_states: the static loss scaler
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),  # optim_states: fp16 with dynamic loss scaling
    ("deepspeed.utils.tensor_fragment", "fragment_address"),      # optim_states (ZeRO 1/2): param_slice_mappings
)
"""``(module, name)`` of every non-torch type DeepSpeed 0.19 pickles into its checkpoint files."""

# The checkpoint engines whose ``load(path, map_location)`` is a plain ``torch.load`` of a file ``torch.save`` wrote.
_FILE_ENGINES = ("TorchCheckpointEngine", "FastCheckpointEngine", "DecoupledCheckpointEngine")
_TRUST_HINT = "pass trust_checkpoint=True to load_checkpoint (the DeepSpeed trainer: --trust-checkpoint) only for a " \
              "checkpoint you trust"


class UnsafeCheckpointError(ValueError):
    """A checkpoint file needs a type outside the allow-list to be unpickled (and so could run code)."""


class DamagedCheckpointError(ValueError):
    """A checkpoint file unpickles only to something DeepSpeed never writes (an allowed type with a state it cannot
    have, or a file torch cannot read)."""


def _deepspeed_type(module_name: str, name: str):
    try:
        return getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError):  # another DeepSpeed version: a type it no longer has is not needed
        return None


def _zero_stage(*args):
    """What ``deepspeed.runtime.zero.config.ZeroStageEnum`` unpickles to: ``ZeroStageEnum(value)`` for a stage
    DeepSpeed defines, given as the one plain ``int`` it pickles. Being a function, not the enum, its result is not
    a type the unpickler will write a state into (the members are shared by the whole process)."""
    enum = _deepspeed_type("deepspeed.runtime.zero.config", "ZeroStageEnum")
    stages = sorted({member.value for member in enum})
    if len(args) != 1 or type(args[0]) is not int or args[0] not in stages:
        shown = ", ".join(repr(a)[:40] for a in args)
        raise DamagedCheckpointError(f"ZeroStageEnum({shown}): the ZeRO stages are {stages}")
    return enum(args[0])


def _allowed_globals() -> list:
    found = []
    for module_name, name in DEEPSPEED_CHECKPOINT_GLOBALS:
        kind = _deepspeed_type(module_name, name)
        if kind is None:
            continue
        found.append((_zero_stage, f"{module_name}.{name}") if name == "ZeroStageEnum" else kind)
    return found


# ------------------------------------------------------------------------------- the allowed types' states
def _plain_int(low: int) -> Callable[[Any], bool]:
    return lambda v: type(v) is int and v >= low


def _positive(v) -> bool:
    return (type(v) is int or (type(v) is float and math.isfinite(v))) and v > 0


def _flag(v) -> bool:
    return type(v) is bool


_INT0, _INT1 = _plain_int(0), _plain_int(1)
_SCALER_STATE = {"cur_scale": (_positive, "a finite positive number"), "dynamic": (_flag, "a bool")}
_DYNAMIC_SCALER_STATE = {
    **_SCALER_STATE,
    "cur_iter": (_INT0, "an int >= 0"),
    "last_overflow_iter": (_plain_int(-1), "an int >= -1"),
    "scale_factor": (lambda v: _positive(v) and v > 1, "a finite number > 1"),
    "scale_window": (_INT1, "an int >= 1"),
    "min_scale": (_positive, "a finite positive number"),
    "delayed_shift": (_INT1, "an int >= 1"),
    "cur_hysteresis": (_INT1, "an int >= 1"),
    "consecutive_hysteresis": (_flag, "a bool"),
    "raise_error_at_min_scale": (_flag, "a bool"),
    "dtype": (lambda v: isinstance(v, torch.dtype) and v.is_floating_point, "a floating torch.dtype"),
}
"""The instance attributes of DeepSpeed 0.19's loss scalers (set by their ``__init__``) and what each may hold:
a scaler restored with a non-finite or zero scale scales every loss by it; an unknown attribute would shadow a
method."""


def _object_problem(obj) -> str:
    """Why ``obj`` (an instance of an allowed DeepSpeed type) is not something DeepSpeed writes ('' if it is)."""
    name = type(obj).__name__
    if name in ("LossScaler", "DynamicLossScaler"):
        spec = _DYNAMIC_SCALER_STATE if name == "DynamicLossScaler" else _SCALER_STATE
        state = vars(obj)
        unknown = sorted(set(state) - set(spec), key=str)
        missing = sorted(set(spec) - set(state))
        if unknown or missing:
            return (f"{name} with attributes {sorted(state, key=str)}; DeepSpeed's has exactly {sorted(spec)}")
        for key, (check, want) in spec.items():
            if not check(state[key]):
                return f"{name} with {key}={state[key]!r:.60}, which must be {want}"
        if name == "DynamicLossScaler":
            if state["cur_hysteresis"] > state["delayed_shift"]:
                return f"{name} with cur_hysteresis {state['cur_hysteresis']} > delayed_shift {state['delayed_shift']}"
            if state["last_overflow_iter"] > state["cur_iter"]:
                return (f"{name} with last_overflow_iter {state['last_overflow_iter']} after cur_iter "
                        f"{state['cur_iter']}")
        return ""
    if name == "fragment_address":
        fields = [f.name for f in dataclasses.fields(obj)]
        if set(vars(obj)) != set(fields):
            return f"fragment_address with attributes {sorted(vars(obj), key=str)}; DeepSpeed's has exactly {fields}"
        for key in fields:
            if not _INT0(getattr(obj, key)):
                return f"fragment_address with {key}={getattr(obj, key)!r:.60}, which must be an int >= 0"
        return ""
    return ""


def _check_loaded(state, path: str) -> None:
    """Every object of an allowed DeepSpeed type in ``state`` is one DeepSpeed could have written; no type (or
    :func:`_zero_stage`) stands where a value belongs. Raises :class:`DamagedCheckpointError` naming ``path`` and
    where in the file the object is."""
    allowed = [kind for kind in (_deepspeed_type(m, n) for m, n in DEEPSPEED_CHECKPOINT_GLOBALS) if kind is not None]
    checked = tuple(kind for kind in allowed if kind.__name__ != "ZeroStageEnum")
    pending, seen = [(state, "")], set()
    while pending:
        value, where = pending.pop()
        if torch.is_tensor(value) or id(value) in seen:
            continue
        seen.add(id(value))  # the unpickler can build a container that holds itself
        if isinstance(value, dict):
            pending.extend((item, f"{where}[{key!r:.40}]") for key, item in value.items())
            pending.extend((key, f"{where} (a key)") for key in value)
        elif isinstance(value, (list, tuple, set, frozenset)):
            pending.extend((item, f"{where}[{i}]") for i, item in enumerate(value))
        elif value is _zero_stage or any(value is kind for kind in allowed):
            name = "ZeroStageEnum" if value is _zero_stage else value.__name__
            raise DamagedCheckpointError(f"checkpoint file {path} holds the type {name} itself at "
                                         f"{where or 'the top'}, where DeepSpeed writes a value")
        elif isinstance(value, checked):
            problem = _object_problem(value)
            if problem:
                raise DamagedCheckpointError(f"checkpoint file {path} holds a {problem} (at {where or 'the top'}); "
                                             f"DeepSpeed never writes that, so the file is damaged or crafted")


def _offending_globals(path: str, error: Exception) -> str:
    """The globals of ``path`` outside the allow-list, for the error message."""
    allowed = {f"{m}.{n}" for m, n in DEEPSPEED_CHECKPOINT_GLOBALS}
    try:
        names = [g for g in torch.serialization.get_unsafe_globals_in_checkpoint(path) if g not in allowed]
    except Exception:  # not a zip checkpoint (legacy format), or unreadable: torch's own message names the global
        names = []
    if names:
        return ", ".join(names)
    # torch's own reason follows its generic preamble (e.g. an allowed type's state written into an enum member)
    reason = [line.strip() for line in str(error).split("WeightsUnpickler error:", 1)[-1].splitlines() if line.strip()]
    return f"what the weights-only unpickler refuses ({reason[0] if reason else 'no reason given'})"


def _weights_only_load(path: str, map_location=None):
    """``torch.load(path, weights_only=True)`` admitting the DeepSpeed types of :data:`DEEPSPEED_CHECKPOINT_GLOBALS`
    (their states checked). Raises :class:`UnsafeCheckpointError` for a file needing another type,
    :class:`DamagedCheckpointError` for one torch cannot read or whose DeepSpeed objects DeepSpeed never writes;
    both name the file. A file that cannot be opened raises the ``OSError`` DeepSpeed expects."""
    with torch.serialization.safe_globals(_allowed_globals()):
        try:
            state = torch.load(path, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as exc:
            raise UnsafeCheckpointError(
                f"refusing to load checkpoint file {path}: it needs {_offending_globals(path, exc)}, which DeepSpeed "
                f"checkpoints do not hold, and unpickling it could run code; {_TRUST_HINT}") from None
        except OSError:
            raise
        except Exception as exc:  # an allowed type given arguments it refuses, or a file torch cannot read
            first = (str(exc).strip().splitlines() or [""])[0]
            raise DamagedCheckpointError(f"cannot load checkpoint file {path}: {type(exc).__name__}: {first}") \
                from None
    _check_loaded(state, str(path))
    return state


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
