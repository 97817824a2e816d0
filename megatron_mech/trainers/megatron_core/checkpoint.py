"""Per-rank checkpoints for our megatron-core entry point: model, optimizer, scheduler, RNG, monitor and MoLS.

Layout: ``<dir>/iter_<step:07d>/rank<r:04d>.pt`` (plus ``distopt_rank<r:04d>.pt`` with the distributed
optimizer's sharded state, written by DP rank 0 of each optimizer) and ``<dir>/latest_checkpointed_iteration.txt``,
which moves only after every rank has written its file (a killed save never becomes "latest"). Resume needs the
same parallel layout (it is recorded and checked); resharding is Megatron-LM's dist-checkpointing's job in a
user's fork.

The hook's state is one entry, ``"mech"`` (monitors, detectors, MoLS, first-alert step). Load order matters:
optimizer → hook (MoLS rewrites each group's ``max_lr``/``min_lr``) → scheduler (recomputes the lrs from them).
The distributed optimizer's parameter state is loaded through :func:`load_distributed_optimizer_state`, which works
around two megatron-core 0.16.1 problems seen without TE/apex (see there).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import torch

from megatron_mech.hook import naming_damaged_state
from megatron_mech.optim import inner_optimizer, leaf_optimizers
from megatron_mech.records.run_directory import (  # noqa: F401 (the run id helpers are re-exported)
    MAX_SMALL_FILE_BYTES,
    RUN_ID_FILE,
    read_run_id,
    write_run_id,
)
from megatron_mech.records.safe_files import (
    open_regular,
    read_small_file,
    refuse_symlink,
    refuse_unsafe_file,
    write_file_atomically,
)

__all__ = ["RUN_ID_FILE", "check_model_shapes", "check_mols_match", "load_checkpoint",
           "load_distributed_optimizer_state", "read_checkpoint_file", "read_run_id", "read_tracker", "save_checkpoint",
           "write_run_id"]

TRACKER = "latest_checkpointed_iteration.txt"


def read_tracker(load_dir) -> Optional[int]:
    """The iteration ``<load_dir>/latest_checkpointed_iteration.txt`` names (None when there is no tracker).
    A tracker that does not hold an iteration number, or names an iteration directory that does not exist, is
    refused naming the file."""
    tracker = Path(load_dir) / TRACKER
    if not os.path.lexists(tracker):
        return None
    text = read_small_file(tracker, MAX_SMALL_FILE_BYTES, "a checkpoint tracker").decode("utf-8", "replace").strip()
    try:
        step = int(text)
    except ValueError:
        raise ValueError(f"checkpoint tracker {tracker} holds {text[:40]!r}, not an iteration number (--save "
                         f"writes it; restore it or point --load at another checkpoint)") from None
    if step < 0:
        raise ValueError(f"checkpoint tracker {tracker} holds iteration {step}; iterations are >= 0")
    directory = Path(load_dir) / f"iter_{step:07d}"
    if not directory.is_dir():
        raise ValueError(f"checkpoint tracker {tracker} names iteration {step}, but {directory} does not exist")
    return step


def _rng_state() -> dict:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    return {"torch": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}


def _set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    torch.set_rng_state(state["torch"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _uses_distributed_optimizer(optimizer) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return any(isinstance(o, DistributedOptimizer) for o in leaf_optimizers(optimizer))


def load_distributed_optimizer_state(optimizer, filename: str) -> None:
    """``optimizer.load_parameter_state(filename)`` made to work with torch AdamW (megatron-core 0.16.1, no TE/apex).

    * The fp32 shards are views of the model parameters, so the copy must run under ``no_grad``.
    * ``_set_main_param_and_optimizer_states`` copies every key of the live AdamW state, including ``step``,
      which the dp-zero file does not hold (``KeyError: 'step'``): set it aside and put it back — as one tensor
      per parameter, because megatron's non-TE ``DistributedOptimizer.load_state_dict`` gives every parameter
      the *same* step tensor, which torch AdamW's foreach path then increments once per parameter per step
      (a wrong bias correction after a resume).

    The file is read by us with ``weights_only=True`` (:func:`_read_parameter_state`), not by megatron-core's
    ``load_parameter_state``, whose plain ``torch.load`` unpickles anything when ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD``
    is set; the state is then handed to the same per-optimizer ``load_parameter_state_from_dp_zero``.
    """
    stash = []
    for leaf in leaf_optimizers(optimizer):
        inner = inner_optimizer(leaf)
        for state in (inner.state.values() if inner is not None else ()):
            if "step" in state:
                stash.append((state, state.pop("step")))
    try:
        with torch.no_grad():
            _load_parameter_state(optimizer, filename)
    finally:
        for state, step in stash:
            state["step"] = step.detach().clone()


def _load_weights_only(path):
    """``torch.load(path, weights_only=True)`` onto the CPU, any failure a ``RuntimeError`` naming the file.

    ``weights_only=True`` is passed explicitly: torch's default alone is not enough, since
    ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` (set to load old checkpoints) turns the default into a full unpickler,
    while an explicit ``weights_only=True`` is kept whatever the environment says."""
    try:
        with open_regular(path) as f:  # never blocks on a FIFO planted as a checkpoint file
            return torch.load(f, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise RuntimeError(f"cannot read checkpoint file {path} (loaded with weights_only=True: only tensors and "
                           f"plain Python data are accepted): {exc}") from exc


def _read_parameter_state(filename: str, entries: int):
    """The distributed optimizer's parameter state in ``filename``, read weights-only: one dict (``entries`` 0),
    or the list ``ChainedOptimizer.save_parameter_state`` writes, which must reach index ``entries - 1``."""
    state = _load_weights_only(filename)
    if not entries and not isinstance(state, dict):
        raise RuntimeError(f"checkpoint file {filename} does not hold a distributed optimizer state (got "
                           f"{type(state).__name__})")
    if entries and not (isinstance(state, list) and len(state) >= entries):
        got = f"a list of {len(state)}" if isinstance(state, list) else type(state).__name__
        raise RuntimeError(f"checkpoint file {filename} does not hold the states of this run's chained "
                           f"distributed optimizers ({entries} expected, got {got})")
    return state


def _load_parameter_state(optimizer, filename: str) -> None:
    """What megatron-core 0.16.1's ``load_parameter_state`` (of ``DistributedOptimizer`` and
    ``ChainedOptimizer``) does, except that the file is read by :func:`_read_parameter_state`: DP rank 0 of each
    optimizer reads it, and every rank takes its shards through ``load_parameter_state_from_dp_zero``."""
    chained = list(getattr(optimizer, "chained_optimizers", None) or [optimizer])
    single = len(chained) == 1
    entries = 0 if single else 1 + max((i for i, leaf in enumerate(chained)
                                        if hasattr(leaf, "load_parameter_state_from_dp_zero")), default=-1)
    states = None
    for index, leaf in enumerate(chained):
        if not hasattr(leaf, "load_parameter_state_from_dp_zero"):
            continue
        if single and getattr(leaf, "is_stub_optimizer", False):
            return
        if leaf.data_parallel_group.rank() == 0 and states is None:
            states = _read_parameter_state(filename, entries)
        state = None if states is None else states if single else states[index]
        leaf.load_parameter_state_from_dp_zero(state)


def read_checkpoint_file(path) -> dict:
    """Load one of our per-rank checkpoint files with ``weights_only=True``.

    Our files hold only tensors, numbers, strings, lists and dicts, which the restricted unpickler accepts; a
    file whose pickle would construct anything else (e.g. call ``os.system``) is refused before any of its code
    runs. Any failure becomes a ``RuntimeError`` naming the file; the file is left untouched.
    """
    state = _load_weights_only(path)
    if not isinstance(state, dict):
        raise RuntimeError(f"checkpoint file {path} does not hold a state dict (got {type(state).__name__})")
    return state


def _mols_enabled(hook) -> bool:
    return hook is not None and getattr(hook, "mols", None) is not None


def check_mols_match(state: dict, hook, directory) -> None:
    """MoLS splits the optimizer's parameter groups per module class: a checkpoint saved with it on cannot be
    loaded into an optimizer built with it off (or the reverse). Refuse by name, before megatron's group errors."""
    saved = state.get("mols_enabled")
    if saved is None:  # checkpoints without the flag: an enabled MoLS always saved a non-empty state
        saved = bool(state.get("mols") or (state.get("mech") or {}).get("mols"))
    current = _mols_enabled(hook)
    if saved != current:
        raise ValueError(f"checkpoint {directory} was saved with MoLS {'on' if saved else 'off'} (--mech-mols), "
                         f"this run has it {'on' if current else 'off'}: the optimizer's parameter groups differ. "
                         f"{'Add' if saved else 'Remove'} --mech-mols to resume it")


def check_model_shapes(saved, current: dict, path) -> None:
    """Refuse a checkpoint of another model before torch's ``load_state_dict`` does, naming the file, the first
    parameters that differ and their shapes there and here (``saved``: the file's model state; ``current``: the
    run's)."""
    if not isinstance(saved, dict):
        raise ValueError(f"checkpoint file {path} holds no model state (its 'model' entry is "
                         f"{type(saved).__name__})")
    differences = [f"{key} is {tuple(value.shape)} there, {tuple(current[key].shape)} here"
                   for key, value in saved.items()
                   if key in current and torch.is_tensor(value) and torch.is_tensor(current[key])
                   and value.shape != current[key].shape]
    missing = [key for key in current if key not in saved and not key.endswith("_extra_state")]
    unexpected = [key for key in saved if key not in current and not key.endswith("_extra_state")]
    differences += [f"{key} is missing there" for key in missing[:3]]
    differences += [f"{key} is not in this model" for key in unexpected[:3]]
    if differences:
        raise ValueError(f"checkpoint file {path} holds another model than this run builds: "
                         f"{'; '.join(differences[:3])}{' ...' if len(differences) > 3 else ''}. Resume with the "
                         f"model flags it was saved with (--num-layers, --hidden-size, --num-attention-heads, "
                         f"--ffn-hidden-size, --num-experts, ...)")


def save_checkpoint(save_dir, step: int, model, optimizer, scheduler, layout: dict, hook=None,
                    run_id: Optional[str] = None) -> Path:
    """Every rank writes its file (rank 0 also the ``run_id``, when given); the tracker moves after a barrier.
    Returns the iteration directory."""
    rank = torch.distributed.get_rank()
    directory = Path(save_dir) / f"iter_{step:07d}"
    refuse_symlink(directory)  # mkdir accepts a link to a directory elsewhere, and every file would go there
    directory.mkdir(parents=True, exist_ok=True)
    if _uses_distributed_optimizer(optimizer):  # sharded optimizer state: written by DP rank 0 of each group
        sharded = directory / f"distopt_rank{rank:04d}.pt"
        refuse_unsafe_file(sharded)  # megatron-core opens it itself: a link or a FIFO there is refused first
        optimizer.save_parameter_state(str(sharded))
    state = {"iteration": step, "layout": layout, "model": model.state_dict(),
             "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "rng": _rng_state(),
             "mech": hook.state_dict() if hook is not None else None, "mols_enabled": _mols_enabled(hook)}
    # atomic: a rank file that exists is complete; a full disk fails the save and leaves no partial file
    write_file_atomically(directory / f"rank{rank:04d}.pt", lambda f: torch.save(state, f))
    if run_id is not None and rank == 0:
        write_run_id(directory, run_id)
    torch.distributed.barrier()
    if rank == 0:  # atomic too: a tracker cut by a full disk would name no checkpoint at all
        write_file_atomically(Path(save_dir) / TRACKER, str(step))
    torch.distributed.barrier()
    return directory


def load_checkpoint(load_dir, model, optimizer, scheduler, layout: dict, hook=None,
                    exit_on_missing: bool = False) -> int:
    """Restore this rank's state (the hook's too); returns the checkpoint's step, or 0 if nothing is saved."""
    step = read_tracker(load_dir)
    if step is None:
        if exit_on_missing:
            raise FileNotFoundError(f"--load {load_dir}: no {TRACKER}")
        return 0
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    directory = Path(load_dir) / f"iter_{step:07d}"
    path = directory / f"rank{rank:04d}.pt"
    state = read_checkpoint_file(path)
    if state.get("layout") != layout:
        raise ValueError(f"checkpoint {directory} was written with parallel layout {state.get('layout')}, this run "
                         f"is {layout}; per-rank checkpoints need the same layout")
    check_mols_match(state, hook, directory)
    check_model_shapes(state.get("model"), model.state_dict(), path)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    if _uses_distributed_optimizer(optimizer):
        load_distributed_optimizer_state(optimizer, str(directory / f"distopt_rank{rank:04d}.pt"))
    mech = state.get("mech")
    if mech is not None and state.get("mols"):  # checkpoints of earlier releases kept MoLS in its own entry
        mech = {**mech, "mols": state["mols"]}
    if hook is not None and mech is not None:
        # before the scheduler: MoLS rewrites the groups it recomputes lrs from
        with naming_damaged_state(f"checkpoint file {path}"):
            hook.load_state_dict(mech, source=f"checkpoint file {path}")
    scheduler.load_state_dict(state["scheduler"])
    _set_rng_state(state["rng"])
    return step
