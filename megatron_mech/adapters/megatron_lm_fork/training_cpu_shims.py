"""Run a Megatron-LM fork's own training layer (``megatron/training/``) on CPU over gloo.

``megatron_mech.adapters.megatron_core.cpu_shims`` makes megatron-core train on CPU. A Megatron-LM fork adds its
training layer on top (``initialize_megatron``, ``pretrain``, ``get_model``, ``train``), which has its own CUDA-only
steps. This module patches exactly those, process-wide, **only when** ``torch.cuda.is_available()`` is
False; on a GPU machine :func:`apply_training_cpu_shims` patches nothing and returns ``[]``.

It is called by the patched ``pretrain_gpt.py`` (through
:func:`megatron_mech.adapters.megatron_lm_fork.callsites.on_start`) after the fork's modules are imported and before
``pretrain`` runs. Each shim's comment names the failing call of Megatron-LM core_v0.16.1.

What a fork's own ``pretrain_gpt.py`` (core_v0.16.1) needed to train on CPU over gloo, found by running it:

* packages beyond megatron-core's: ``six``, ``regex``, ``pydantic`` (imports), ``triton`` (imported at module
  level by ``megatron/core/transformer/custom_layers/batch_invariant_kernels.py``; no kernel runs),
  ``pybind11`` plus ``make`` and a C++ compiler (the fork builds its dataset helpers at start-up) — the
  ``megatron-lm`` extra of this package;
* megatron-core's CPU shims (:mod:`megatron_mech.adapters.megatron_core.cpu_shims`) and the training-layer shims below:
  ``allow_no_cuda`` (the CUDA assert), ``model_parallel_init`` (model-parallel set-up and RNG seeding gated on a
  CUDA device count), ``compile_dependencies`` (helpers built with this interpreter; no fused-kernel build),
  ``jit_warmup`` (a CUDA-only torch.compile warm-up), ``streams`` (``torch.cuda.Stream`` around the DDP wrap),
  ``cuda_rng_state`` (the rerun state machine and checkpoints save the CUDA generator state), ``device_arch``
  (argument validation asks the GPU's architecture when TP or CP > 1), ``distopt_checkpoint`` (saving and
  loading ``--use-distributed-optimizer`` checkpoints through megatron-core's PyTorch-Adam branch);
* a tokenizer that works offline: ``--tokenizer-type NullTokenizer --vocab-size N`` over pre-tokenized
  ``.bin/.idx`` data (``megatron-mech prepare-data``).

Run-time requirements on CPU (flags, not shims): ``--distributed-backend gloo``, ``--transformer-impl
local``, ``--use-cpu-initialization``, ``--no-gradient-accumulation-fusion``, every fusion off
(``--no-bias-gelu-fusion --no-bias-dropout-fusion --no-masked-softmax-fusion --no-persist-layer-norm
--no-rope-fusion``), and for MoE ``--disable-bias-linear``. :data:`CPU_TRAINING_FLAGS` lists them. Megatron's own
``--bf16`` (float32 main params, with or without ``--use-distributed-optimizer``, legacy or ``torch_dist``
checkpoints) trains on CPU with torch's bf16 kernels and needs no shim of its own.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import subprocess
import sys
import sysconfig
from typing import Callable, Dict, List

import torch

from megatron_mech.adapters.megatron_core import cpu_shims

__all__ = ["CPU_TRAINING_FLAGS", "TRAINING_SHIMS", "apply_training_cpu_shims", "applied_training_cpu_shims"]

logger = logging.getLogger(__name__)

# Megatron-LM command-line flags a CPU run needs (the training-layer equivalent of CPU_CONFIG_KWARGS).
CPU_TRAINING_FLAGS = (
    "--distributed-backend", "gloo", "--transformer-impl", "local", "--use-cpu-initialization",
    "--no-gradient-accumulation-fusion", "--no-bias-gelu-fusion", "--no-bias-swiglu-fusion",
    "--no-bias-dropout-fusion", "--no-masked-softmax-fusion", "--no-persist-layer-norm", "--no-rope-fusion",
)

TRAINING_SHIMS: Dict[str, Callable[[], None]] = {}
_APPLIED: List[str] = []


def _shim(name: str):
    def register(fn):
        TRAINING_SHIMS[name] = fn
        return fn

    return register


@contextlib.contextmanager
def _one_virtual_device():
    """``torch.cuda.device_count()`` reads 1 and ``set_device`` is a no-op inside the block.

    Megatron-LM gates model-parallel set-up and the model-parallel RNG seeding on ``device_count() > 0``
    (``initialize.py`` ``_initialize_distributed`` / ``_set_random_seed``); on CPU both must still run. Kept
    to those two calls: elsewhere device_count stays 0.
    """
    count, set_device = torch.cuda.device_count, torch.cuda.set_device
    torch.cuda.device_count = lambda: 1
    torch.cuda.set_device = lambda device: None
    try:
        yield
    finally:
        torch.cuda.device_count, torch.cuda.set_device = count, set_device


@_shim("allow_no_cuda")
def _apply_allow_no_cuda():
    # initialize.py:62 `assert torch.cuda.is_available(), "Megatron requires CUDA."` unless allow_no_cuda;
    # pretrain() calls initialize_megatron by the name it imported into training.py.
    from megatron.training import initialize, training

    original = initialize.initialize_megatron

    @functools.wraps(original)
    def initialize_megatron(*args, **kwargs):
        kwargs["allow_no_cuda"] = True
        return original(*args, **kwargs)

    initialize.initialize_megatron = initialize_megatron
    training.initialize_megatron = initialize_megatron


@_shim("model_parallel_init")
def _apply_model_parallel_init():
    # initialize.py:319-395 `_initialize_distributed` calls `initialize_model_parallel` only when
    # `torch.cuda.device_count() > 0`; `_set_random_seed` (421) seeds the model-parallel RNG tracker (which
    # core attention always forks) only then too. The rng_tracker shim of cpu_shims makes the seeding
    # itself CPU-safe.
    from megatron.training import initialize

    for name in ("_initialize_distributed", "_set_random_seed"):
        original = getattr(initialize, name)

        @functools.wraps(original)
        def wrapped(*args, __original=original, **kwargs):
            with _one_virtual_device():
                return __original(*args, **kwargs)

        setattr(initialize, name, wrapped)


def _compile_dataset_helpers() -> None:
    """Build ``megatron/core/datasets/helpers_cpp`` with *this* interpreter's pybind11 and extension suffix.

    The fork's Makefile asks ``python3`` on PATH for both, which is not the training interpreter in a
    virtual environment (and may lack pybind11): pass them to make explicitly.
    """
    from megatron.core import datasets

    src_dir = os.path.dirname(os.path.abspath(datasets.__file__))
    includes = subprocess.run([sys.executable, "-m", "pybind11", "--includes"], check=True, text=True,
                              capture_output=True).stdout.strip()
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    result = subprocess.run(["make", "-C", src_dir, f"CPPFLAGS={includes}", f"LIBEXT={suffix}"],
                            text=True, capture_output=True)
    if result.returncode != 0:
        raise RuntimeError(f"building the dataset helpers in {src_dir} failed (needs make, a C++ compiler and "
                           f"pybind11):\n{result.stdout}\n{result.stderr}")


@_shim("compile_dependencies")
def _apply_compile_dependencies():
    # initialize.py:179 `_compile_dependencies`: the dataset helpers via the fork's Makefile (python3 on PATH)
    # and `fused_kernels.load`, which runs `$CUDA_HOME/bin/nvcc -V`. On CPU: the helpers only, built by
    # rank 0 while the others wait; no fused kernels (every fusion is off on CPU).
    from megatron.training import initialize

    def _compile_dependencies():
        if torch.distributed.get_rank() == 0:
            _compile_dataset_helpers()
        torch.distributed.barrier()

    initialize._compile_dependencies = _compile_dependencies


@_shim("jit_warmup")
def _apply_jit_warmup():
    # initialize.py:439 `set_jit_fusion_options` -> `_warmup_jit_function` runs the bias-gelu / bias-dropout
    # fusions on device="cuda" tensors through torch.compile; those fusions are off on CPU.
    from megatron.training import initialize, training

    def set_jit_fusion_options(tp_size=None):  # 0.19 training.py passes tp_size=; earlier releases nothing
        logger.info("CPU run: JIT fusion warm-up skipped (fusions are off)")

    initialize.set_jit_fusion_options = set_jit_fusion_options
    training.set_jit_fusion_options = set_jit_fusion_options


# What `get_device_arch_version` reads on CPU: the first architecture (Blackwell, 10) without a limit on CUDA
# hardware work queues, because a CPU has no such queues either.
_CPU_DEVICE_ARCH = 10


@_shim("device_arch")
def _apply_device_arch():
    # arguments.py:928 validate_args: with TP or CP > 1 it calls `get_device_arch_version()`
    # (`torch.cuda.get_device_properties("cuda:0").major`) to decide whether CUDA_DEVICE_MAX_CONNECTIONS=1 is
    # required, a rule about ordering kernels on CUDA streams. On CPU there is no device to ask and no stream to
    # order: the version of an architecture without that rule. validate_args runs inside pretrain, after this.
    from megatron.training import arguments, utils

    def get_device_arch_version():
        return _CPU_DEVICE_ARCH

    arguments.get_device_arch_version = get_device_arch_version
    utils.get_device_arch_version = get_device_arch_version


class _NoStream:
    """Stands in for ``torch.cuda.Stream`` on CPU, where work is synchronous: waits are no-ops."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other) -> None:
        pass

    def synchronize(self) -> None:
        pass


@_shim("streams")
def _apply_streams():
    # training.py:1325 get_model: `ddp_stream = torch.cuda.Stream()`, `wait_stream(current_stream())`,
    # `with torch.cuda.stream(ddp_stream):` around the DDP wrap.
    torch.cuda.Stream = _NoStream
    torch.cuda.current_stream = lambda device=None: _NoStream()
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
    torch.cuda.empty_cache = lambda: None


_NO_CUDA_RNG_STATE = torch.zeros(0, dtype=torch.uint8)


@_shim("cuda_rng_state")
def _apply_cuda_rng_state():
    # rerun_state_machine.py:957 `_save_state` (every step) and checkpointing.py:343 `get_rng_state` save
    # `torch.cuda.get_rng_state()` next to the CPU generator's state, and restore it with `set_rng_state`.
    # Without CUDA there is no CUDA generator: an empty state, and restoring it is a no-op. The CPU generator
    # state is saved and restored by Megatron itself (`torch_rng_state`).
    torch.cuda.get_rng_state = lambda device="cuda": _NO_CUDA_RNG_STATE.clone()
    torch.cuda.set_rng_state = lambda new_state, device="cuda": None


@_shim("distopt_checkpoint")
def _apply_distopt_checkpoint():
    """``--use-distributed-optimizer`` checkpoints through megatron-core's PyTorch-Adam branch, fp32 parameters."""
    # checkpointing.py:1653 (torch_dist: `generate_state_dict` -> `optimizer.sharded_state_dict(is_loading=True)`)
    # and :1794/:1810 (`optimizer.load_state_dict`, legacy `optimizer.load_parameter_state`). Without apex or TE,
    # which need CUDA, megatron-core's distributed optimizer wraps PyTorch's Adam (core
    # optimizer/distrib_optimizer.py:21-36, HAVE_APEX_OR_TE = False), whose per-parameter state holds the step
    # counter; that branch's checkpoint code fails or resumes with wrong state in the three methods wrapped here.
    # (megatron_mech.trainers.megatron_core.checkpoint works around the last two for our own launcher, which saves in
    # its own format.)
    from megatron.core.optimizer import distrib_optimizer

    cls = distrib_optimizer.DistributedOptimizer
    cls.state_dict = _state_dict_before_first_step(cls.state_dict)
    cls.load_state_dict = _own_step_counters(cls.load_state_dict)
    cls._set_main_param_and_optimizer_states = _load_shard_keeping_step(cls._set_main_param_and_optimizer_states)


def _state_dict_before_first_step(state_dict):
    """``DistributedOptimizer.state_dict`` that also works before the inner optimizer's first step.

    On the PyTorch-Adam branch ``state_dict`` takes the step from the per-parameter state
    (``optimizer/distrib_optimizer.py:640-642``: ``steps = {s["step"] for s in state}; assert len(steps) == 1``).
    PyTorch's Adam creates that state only in its first ``step()``, and a ``torch_dist`` load asks for the state
    dict of the fresh optimizer first (``sharded_state_dict(is_loading=True)``, line 1246): no step, the assert
    fails. The apex/TE branch (lines 654-666) reads the step from the param groups and allows none. Here the
    fresh optimizer reports step 0, the count of updates it has made: its state gets ``step`` for the call only
    and is left as it was.
    """
    @functools.wraps(state_dict)
    def wrapped(self):
        from megatron.core.optimizer import distrib_optimizer

        inner = getattr(self, "optimizer", None)
        if distrib_optimizer.HAVE_APEX_OR_TE or not isinstance(inner, torch.optim.Optimizer):
            return state_dict(self)
        state = inner.state
        if any("step" in s for s in state.values()):
            return state_dict(self)
        params = [p for group in inner.param_groups for p in group["params"]]
        targets = [p for p, s in state.items() if s] or params[:1]
        created = [p for p in targets if p not in state]
        for p in targets:
            state[p]["step"] = torch.zeros((), dtype=torch.float32)
        try:
            return state_dict(self)
        finally:
            for p in targets:
                state[p].pop("step", None)
            for p in created:
                state.pop(p, None)

    return wrapped


def _own_step_counters(load_state_dict):
    """``DistributedOptimizer.load_state_dict`` after which every parameter's Adam ``step`` is its own tensor.

    On the PyTorch-Adam branch megatron-core puts one tensor into every parameter's state
    (``optimizer/distrib_optimizer.py:819-825``, ``step = torch.tensor(steps[0])``, then ``s["step"] = step`` for
    each ``s``; PyTorch's ``Optimizer.load_state_dict`` keeps ``step`` tensors as they are). Adam increments each
    parameter's step in place, so after a resume the shared counter advances by the number of parameters per
    update and the bias correction differs from the uninterrupted run's. (Its ``HybridDeviceOptimizer`` branch,
    line 836, already gives each parameter a clone.)
    """
    @functools.wraps(load_state_dict)
    def wrapped(self, state_dict):
        from megatron.core.optimizer import distrib_optimizer

        result = load_state_dict(self, state_dict)
        inner = getattr(self, "optimizer", None)
        if not distrib_optimizer.HAVE_APEX_OR_TE and isinstance(inner, torch.optim.Optimizer):
            for s in inner.state.values():
                if isinstance(s.get("step"), torch.Tensor):
                    s["step"] = s["step"].clone()
        return result

    return wrapped


def _load_shard_keeping_step(set_states):
    """``DistributedOptimizer._set_main_param_and_optimizer_states`` for PyTorch's Adam and fp32 parameters.

    It copies every entry of the parameter's optimizer state from the loaded ``tensors``
    (``optimizer/distrib_optimizer.py:936-940``: ``for key in {"param": main_param, **optim_state}:
    dst_tensors[key].copy_(tensors[key])``). Two things break without apex/TE and with fp32:

    * PyTorch's Adam keeps ``step`` in that state (apex/TE keep it in the param groups). A legacy checkpoint's
      shards hold no ``step`` (``load_parameter_state_from_dp_zero``, line 2006: param, exp_avg, exp_avg_sq): a
      ``KeyError``. A ``torch_dist`` one's ``step`` is not loaded at all (lines 1664-1667: "handled separately via
      param_groups", a ``LocalNonpersistentObject``): the copy writes the fresh optimizer's step back over the one
      ``load_state_dict`` has just restored from the param groups. Both: the step stays the param groups' one.
    * For fp32 parameters (every CPU run) the main parameter is a view into the model parameter, taken without
      ``detach`` (line 421 ``shard_model_param = model_param.view(-1)[start:end]``; the fp16/bf16 branch, line 368,
      detaches): the in-place copy with autograd on fails ("a view of a leaf Variable that requires grad is being
      used in an in-place operation"). Without autograd it writes the loaded values into the parameter, as the
      optimizer's own update does.
    """
    @functools.wraps(set_states)
    def wrapped(self, model_param, tensors):
        from megatron.core.optimizer import distrib_optimizer

        inner = getattr(self, "optimizer", None)
        if not distrib_optimizer.HAVE_APEX_OR_TE and isinstance(inner, torch.optim.Optimizer):
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = inner.param_groups[group_index]["params"][group_order]
            step = inner.state.get(main_param, {}).get("step")
            if step is not None:
                tensors = {**tensors, "step": step}
        with torch.no_grad():
            return set_states(self, model_param, tensors)

    return wrapped


def apply_training_cpu_shims() -> List[str]:
    """Apply megatron-core's CPU shims and then the training-layer ones; return the names applied now.

    ``[]`` on a machine with CUDA. Idempotent. Call after the fork's ``megatron.training`` is importable,
    before ``pretrain``.
    """
    if torch.cuda.is_available():
        return []
    applied = cpu_shims.apply_cpu_shims()
    for name, apply in TRAINING_SHIMS.items():
        if name not in _APPLIED:
            apply()
            _APPLIED.append(name)
            applied.append(name)
    return applied


def applied_training_cpu_shims() -> List[str]:
    """Names of the training-layer shims applied in this process so far."""
    return list(_APPLIED)
