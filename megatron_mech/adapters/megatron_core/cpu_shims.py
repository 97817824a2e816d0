"""Run real megatron-core (0.16.1–0.19.2) training on CPU over gloo (no GPU, no Transformer Engine, no apex).

megatron-core assumes CUDA in a few dozen places (``torch.cuda.current_device()``, ``device="cuda"``,
``.cuda()``, CUDA streams, the CUDA RNG tracker, CUDA type-name asserts) and has a couple of code paths
that only work with TE or NCCL. This module patches exactly those places, process-wide, and **only when
``torch.cuda.is_available()`` is False**: on a GPU machine ``apply_cpu_shims()`` patches nothing and
returns ``[]``, so the same training script runs unchanged on both.

Usage (in every rank, i.e. in the torchrun worker)::

    from megatron_mech.adapters.megatron_core import cpu_shims as mcpu

    mcpu.apply_cpu_shims()                       # 1. first, before building anything megatron
    torch.distributed.init_process_group("gloo") # 2. (backend "nccl" on GPU)
    parallel_state.initialize_model_parallel(tp, expert_model_parallel_size=ep)
    mcpu.model_parallel_seed(seed)               # 3. torch.manual_seed + model_parallel_cuda_manual_seed
    model = GPTModel(config, get_gpt_layer_local_spec(...), ...)   # config: see CPU_CONFIG_KWARGS
    model = DistributedDataParallel(config, ddp_config, model)
    mcpu.fast_forward_module(model)              # 4. optional, faster forward (see below)
    optimizer = get_megatron_optimizer(opt_config, [model])
    ... get_forward_backward_func()(...); optimizer.step()          # unchanged megatron code

Public API
----------
``apply_cpu_shims(only=None, exclude=())``
    Apply the shims of ``SHIMS`` (all, or the names in ``only``, minus ``exclude``) that are not applied
    yet; return the names applied by this call. Idempotent: a second call returns ``[]``. Returns ``[]``
    without touching anything when CUDA is available.
``applied_cpu_shims()``
    Names applied so far in this process.
``SHIMS``
    ``name -> Shim(name, apply, doc, needed_from)`` registry, in application order; ``Shim.doc`` is a one-line
    summary, ``Shim.needed_from`` the first megatron-core minor release that needs the shim.
``model_parallel_seed(seed, **kwargs)``
    ``torch.manual_seed(seed)`` then megatron's ``model_parallel_cuda_manual_seed(seed, **kwargs)``. On
    CPU (with the ``rng_tracker`` shim) the tracker states are CPU-generator states with megatron's seed
    arithmetic (data-parallel = seed, tensor-parallel = seed + 2718 + tp_rank, expert-parallel =
    seed + 1024 + 100 * ep_rank + etp_rank). Identical to Megatron-LM's ``_set_random_seed`` core on GPU.
``fast_forward()`` / ``fast_forward_module(module)``
    The ``cuda_device_mode`` shim is a ``TorchFunctionMode``: every torch call goes through a Python hook
    (its cost: ``docs/results/calibration.md``). Nothing inside the forward of the local (non-TE) GPT/MoE layers
    needs the mode, so run the forward under ``torch._C.DisableTorchFunction()``: either
    ``with mcpu.fast_forward(): output = model(...)`` inside ``forward_step_func``, or once
    ``mcpu.fast_forward_module(model)`` (wraps that instance's ``forward``). Both are no-ops when the
    mode is not active (GPU machine). The schedule, backward and optimizer keep running under the mode.
``CPU_CONFIG_KWARGS``
    ``TransformerConfig`` keyword arguments a CPU run needs (CPU init, every CUDA fusion off).
``omp_num_threads(value=None)``
    The intra-op thread count ``OMP_NUM_THREADS`` gives (read as OpenMP reads it, nesting lists included); for
    ``torch.set_num_threads`` on a CPU run. An invalid value raises ``ValueError`` naming the variable.

Model/config requirements on CPU (not shims, configuration): local layer spec
(``get_gpt_layer_local_spec``), ``CPU_CONFIG_KWARGS``, fp32, ``moe_grouped_gemm=False``, for MoE
``add_bias_linear=False`` (with bias ``SequentialMLP`` hits an in-place-on-view error, a megatron-core
bug) and ``sequence_parallel=True`` whenever TP > 1 (megatron's MoE layer requires it in training).
``use_cpu_initialization=True`` initialises every weight from the full master weight on the default CPU
generator, so TP=1 and TP=2 start from identical weights. Activation recompute (``CheckpointFunction``
saves the "CUDA" RNG state: the ``rng_tracker`` shim points it at the CPU generator) and pipeline parallelism
(megatron-core's schedules, one isend/irecv per message: ``batch_p2p_comm=False``) run too.

Shims (see ``SHIMS``; each comment in the code names the failing call and file)
------------------------------------------------------------------------------
``current_device``     ``torch.cuda.current_device()`` -> ``torch.device("cpu")`` (dozens of call sites).
``synchronize``        ``torch.cuda.synchronize()`` -> no-op (``timers.py``, ``parallel_state.py``).
``cuda_device_mode``   TorchFunctionMode: ``device="cuda"`` -> cpu, ``.cuda()``/``record_stream`` no-ops,
                       cuda type names for the optimizer's dtype dispatch.
``rng_tracker``        CPU-generator ``CudaRNGStatesTracker`` (``tensor_parallel/random.py``).
``causal_mask``        CPU causal masks for ``fusions/fused_softmax.py`` (forward runs without the mode).
``te_general_gemm``    ``moe_utils.te_general_gemm = None`` (NameError without TE, a 0.16.1 bug).
``alltoall_stream``    placeholder DtoH stream + CPU split-size conversion in the alltoall dispatcher.
``current_stream``     ``torch.cuda.current_stream()`` -> placeholder stream (0.19's grad sync waits on it).
``torch_norm_sp``      torch LayerNorm/RMSNorm under sequence parallelism (``transformer/torch_norm.py``).
``uneven_gather``      gloo all_gather/reduce_scatter with uneven splits (``tensor_parallel/mappings.py``).
``clip_grads``         ``clip_grad_by_total_norm_fp32`` without the CUDA type assert, ``_foreach_mul_``; without
                      apex, the grad-norm's squares accumulated in float64 (:func:`float64_l2_norm`).

Everything is process-wide (module attributes of torch / megatron) except the TorchFunctionMode, which
torch keeps per thread: call ``apply_cpu_shims()`` on the thread that trains (the main thread).
"""
from __future__ import annotations

import contextlib
import copy
import functools
import os
import re
import sys
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import torch

__all__ = [
    "CPU_CONFIG_KWARGS",
    "SHIMS",
    "Shim",
    "apply_cpu_shims",
    "applied_cpu_shims",
    "fast_forward",
    "fast_forward_module",
    "model_parallel_seed",
    "omp_num_threads",
]

# TransformerConfig kwargs for CPU runs: no fused CUDA kernels, weights initialised on the CPU from the full
# master weight (TP-invariant), no gradient-accumulation fusion (needs the apex/TE CUDA extension).
CPU_CONFIG_KWARGS = dict(
    use_cpu_initialization=True,
    gradient_accumulation_fusion=False,
    bias_activation_fusion=False,
    masked_softmax_fusion=False,
    persist_layer_norm=False,
    bias_dropout_fusion=False,
    apply_rope_fusion=False,
)


@dataclass(frozen=True)
class Shim:
    name: str
    apply: Callable[[], None]
    doc: str
    # The first megatron-core minor release whose CPU training fails without it. Every shim is applied on every
    # release: each replaces a call that can only fail without CUDA, so an older release that never makes the
    # call runs exactly as before.
    needed_from: str = "0.16"


SHIMS: Dict[str, Shim] = {}
_APPLIED: List[str] = []
_MODE: Optional[_CudaToCpuMode] = None


def _shim(name: str, needed_from: str = "0.16"):
    def register(fn):
        doc = (fn.__doc__ or "").strip().splitlines()[0]
        SHIMS[name] = Shim(name, fn, doc, needed_from)
        return fn

    return register


# --------------------------------------------------------------------------------------------------------
# 0. torch.cuda.current_device
# --------------------------------------------------------------------------------------------------------
def _cpu_current_device() -> torch.device:
    return torch.device("cpu")


@_shim("current_device")
def _apply_current_device():
    """torch.cuda.current_device() returns torch.device('cpu') (layers, mappings, rotary, MoE, DDP buffers)."""
    # e.g. tensor_parallel/layers.py `torch.empty(..., device=torch.cuda.current_device())`, DDP grad buffers,
    # MoE router/experts, rotary embeddings. Without it: AssertionError "Torch not compiled with CUDA enabled"
    # while building the model. Returning a cpu *device* makes every `device=current_device()` land on the
    # CPU, also inside the model forward, which runs without the TorchFunctionMode below.
    torch.cuda.current_device = _cpu_current_device


# --------------------------------------------------------------------------------------------------------
# 0a. torch.cuda.synchronize
# --------------------------------------------------------------------------------------------------------
def _cpu_synchronize(device=None) -> None:
    return None


@_shim("synchronize")
def _apply_synchronize():
    """torch.cuda.synchronize() is a no-op (timers.py Timer.start/stop, parallel_state.py)."""
    # megatron/core/timers.py `Timer.start/stop` call torch.cuda.synchronize() unconditionally, so any
    # `config.timers` (Megatron-LM always passes one) breaks the schedule and the optimizer step. CPU ops are
    # synchronous, so a no-op is exact.
    torch.cuda.synchronize = _cpu_synchronize


# --------------------------------------------------------------------------------------------------------
# 0b. TorchFunctionMode: cuda devices -> cpu, .cuda()/record_stream no-ops, cuda type names
# --------------------------------------------------------------------------------------------------------
_CUDA_STR = re.compile(r"^cuda(:\d+)?$")

# Modules whose `tensor.type()` checks are a dtype dispatch (fp16/bf16/fp32 branches) written with CUDA type
# names; they get 'torch.cuda.FloatTensor' for a CPU float tensor. Deliberately a short allowlist: everybody
# else (torch, user code, the clip_grads assert) sees the true type name.
_CUDA_TYPE_NAME_CALLERS = frozenset(
    {"megatron.core.optimizer.optimizer", "megatron.core.optimizer.distrib_optimizer"}
)


def _is_cuda_device(dev) -> bool:
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    return isinstance(dev, str) and _CUDA_STR.match(dev) is not None


class _CudaToCpuMode(torch.overrides.TorchFunctionMode):
    """Rewrites CUDA-only tensor calls made outside the model forward to their CPU equivalents."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            # optimizer/distrib_optimizer.py `send_tensor.cuda()`, utils.py param hashes: stay on the CPU.
            return args[0]
        if func is torch.Tensor.record_stream:
            # moe_utils.maybe_move_tensor_to_cpu / DDP buffers: there are no streams on the CPU.
            return None
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller in _CUDA_TYPE_NAME_CALLERS and not name.startswith("torch.cuda."):
                # optimizer.py:690 / distrib_optimizer.py:420 `param.type() == 'torch.cuda.FloatTensor'`
                # else-raise "Wrapped parameters must be one of torch.cuda.FloatTensor, ...".
                return "torch.cuda." + name[len("torch."):]
            return name
        dev = kwargs.get("device")
        if dev is not None and _is_cuda_device(dev):
            # optimizer.py `torch.tensor([1.0], device='cuda')`, schedules.py total_num_tokens, clip_grads.py,
            # utils.py local_multi_tensor_l2_norm, transformer/utils.py masks, ...
            kwargs = dict(kwargs, device="cpu")
        if any(_is_cuda_device(a) for a in args if isinstance(a, (str, torch.device))):
            # tensor.to("cuda") / tensor.to(torch.device("cuda"))
            args = tuple("cpu" if isinstance(a, (str, torch.device)) and _is_cuda_device(a) else a
                         for a in args)
        return func(*args, **kwargs)


@_shim("cuda_device_mode")
def _apply_cuda_device_mode():
    """TorchFunctionMode: device='cuda' -> cpu, .cuda()/record_stream no-ops, cuda type names for the optimizer."""
    # Hard-coded CUDA outside the model forward: optimizer/optimizer.py (FP32Optimizer `_scale`
    # device='cuda', param.type() dispatch), optimizer/distrib_optimizer.py (type dispatch, .cuda()),
    # optimizer/clip_grads.py + utils.py local_multi_tensor_l2_norm (device='cuda' norms),
    # pipeline_parallel/schedules.py (total_num_tokens device="cuda"). Entered once and never exited.
    # A Python hook on every torch call: keep the model forward out of it with fast_forward().
    global _MODE
    _MODE = _CudaToCpuMode()
    _MODE.__enter__()


@contextlib.contextmanager
def fast_forward():
    """Run the enclosed code (the model forward) without the ``cuda_device_mode`` TorchFunctionMode.

    No-op unless the mode is active. Disables every ``__torch_function__`` override (modes and tensor
    subclasses) in the block, which is safe for the local GPT/MoE layer specs; the CPU causal mask
    (``causal_mask`` shim) and ``current_device`` shim cover what the forward would otherwise need.
    """
    if _MODE is None:
        yield
        return
    with torch._C.DisableTorchFunction():
        yield


def fast_forward_module(module: torch.nn.Module) -> torch.nn.Module:
    """Wrap ``module.forward`` (this instance only) so it runs under :func:`fast_forward`; returns ``module``.

    Use on the outermost model (e.g. the ``DistributedDataParallel`` wrapper or each model chunk). No-op
    when the mode is not active or the module is already wrapped. Forward hooks still run under the mode.
    """
    if _MODE is None or getattr(module, "_megatron_cpu_fast_forward", False):
        return module
    inner = module.forward

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        with torch._C.DisableTorchFunction():
            return inner(*args, **kwargs)

    module.forward = forward
    module._megatron_cpu_fast_forward = True
    return module


# --------------------------------------------------------------------------------------------------------
# 1. RNG tracker on the CPU generator
# --------------------------------------------------------------------------------------------------------
_CpuRNGStatesTracker = None  # class, built lazily (needs megatron's base class)


def _make_cpu_tracker_class():
    from megatron.core.tensor_parallel import random as mrandom

    base = mrandom.CudaRNGStatesTracker
    model_parallel_name = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME

    class CpuRNGStatesTracker(base):
        """megatron's RNG states tracker on torch's default CPU generator (same names, seeds, fork semantics)."""

        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"cpu rng state {name} already exists")
            gen = torch.default_generator
            orig = gen.get_state()
            gen.manual_seed(seed)
            self.states_[name] = gen.get_state()
            gen.set_state(orig)

        @contextlib.contextmanager
        def fork(self, name=model_parallel_name):
            if name not in self.states_:
                raise Exception(f"cpu rng state {name} is not added")
            gen = torch.default_generator
            orig_state = gen.get_state()
            orig_name = self._current_state_name
            if orig_name != "default-rng":
                self.states_[orig_name] = orig_state
            gen.set_state(self.states_[name])
            self._current_state_name = name
            try:
                yield
            finally:
                if self._current_state_name != name:
                    raise Exception(f"current state name {self._current_state_name} is not the same as "
                                    f"the desired state name {name}.")
                self.states_[name] = gen.get_state()
                if orig_name != "default-rng":
                    orig_state = self.states_[orig_name]
                gen.set_state(orig_state)
                self._current_state_name = orig_name

    CpuRNGStatesTracker.__qualname__ = "CpuRNGStatesTracker"
    CpuRNGStatesTracker.__module__ = __name__
    return CpuRNGStatesTracker


@_shim("rng_tracker")
def _apply_rng_tracker():
    """RNG states tracker on the CPU generator (tensor_parallel/random.py uses torch.cuda.get_rng_state)."""
    # model_parallel_cuda_manual_seed -> CudaRNGStatesTracker.add -> torch.cuda.get_rng_state() fails, and
    # the seed cannot be skipped: core attention and GPU-style weight init always fork the tracker.
    # initialize_rng_tracker() instantiates the module-global name `CudaRNGStatesTracker`, so rebinding that
    # name to a subclass makes megatron's own model_parallel_cuda_manual_seed (same seed arithmetic) build a
    # tracker that forks torch's default CPU generator. isinstance checks against the original still hold.
    global _CpuRNGStatesTracker
    from megatron.core.tensor_parallel import random as mrandom

    if _CpuRNGStatesTracker is None:
        _CpuRNGStatesTracker = _make_cpu_tracker_class()
    mrandom.CudaRNGStatesTracker = _CpuRNGStatesTracker
    # Activation recompute (CheckpointFunction -> _get_all_rng_states -> _get_cuda_rng_state ->
    # torch.cuda.random.get_rng_state()) saves and restores the "CUDA" state: on CPU, the default CPU generator
    # is that state (see above), so recompute replays dropout exactly as the first forward drew it.
    mrandom._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda new_state, *args, **kwargs: torch.set_rng_state(new_state)
    tracker = mrandom._CUDA_RNG_STATE_TRACKER
    if tracker is not None and not isinstance(tracker, _CpuRNGStatesTracker):
        # A CUDA tracker was already created (e.g. get_cuda_rng_tracker() called early): rebuild lazily.
        mrandom._CUDA_RNG_STATE_TRACKER = None
        mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = False


def omp_num_threads(value: Optional[str] = None) -> int:
    """The thread count of the outermost parallel level that ``OMP_NUM_THREADS`` (``value``, default the
    environment's) asks for; 1 when it is unset or blank.

    OpenMP reads the variable as a comma-separated list of positive integers, one per nesting level (``4,2``: 4
    threads, each nested region 2), so a launcher or scheduler may well set a list. torch's intra-op pool is the
    outermost level: the first entry is its count. A value OpenMP would not accept raises ``ValueError`` naming
    the variable, instead of failing later inside ``int()``."""
    if value is None:
        value = os.environ.get("OMP_NUM_THREADS", "")
    if not value.strip():
        return 1
    levels = [level.strip() for level in value.split(",")]
    if not all(re.fullmatch(r"[0-9]+", level) and int(level) > 0 for level in levels):
        raise ValueError(f"OMP_NUM_THREADS={value!r} is not a thread count: OpenMP expects a positive integer, or "
                         f"a comma-separated list of them, one per nesting level (e.g. 4 or 4,2)")
    return int(levels[0])


def model_parallel_seed(seed: int, **kwargs) -> None:
    """Seed like Megatron-LM: ``torch.manual_seed(seed)`` then ``model_parallel_cuda_manual_seed(seed, **kwargs)``.

    Call after ``initialize_model_parallel`` and before building the model. On CPU the default CPU
    generator is the "data-parallel" state (megatron's ``torch.cuda.manual_seed`` is a lazy no-op there), and
    the tracker (``rng_tracker`` shim) holds CPU states seeded with megatron's arithmetic.
    """
    from megatron.core import tensor_parallel

    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, **kwargs)



# --------------------------------------------------------------------------------------------------------
# 2. causal masks for fused_softmax (the forward runs without the TorchFunctionMode)
# --------------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=16)
def _cpu_default_causal_mask(sq: int) -> torch.Tensor:
    # Same as transformer/utils.py get_default_causal_mask without device="cuda"; read-only, so cached.
    from megatron_mech.core.masks import causal_mask

    return causal_mask(sq, sq)


def _cpu_sliding_window_causal_mask(sq, skv, window_size) -> torch.Tensor:
    m = torch.ones(sq, skv, dtype=torch.bool)
    mu = torch.triu(m, diagonal=skv - sq - window_size[0])
    return ~torch.tril(mu, diagonal=skv - sq + window_size[1])


@_shim("causal_mask")
def _apply_causal_mask():
    """CPU causal masks for fusions/fused_softmax.py (transformer/utils.py builds them with device='cuda')."""
    # FusedScaleMaskSoftmax.forward_torch_softmax calls get_default_causal_mask(sq) when no mask is passed;
    # transformer/utils.py allocates it with device="cuda". The forward runs under fast_forward() (no
    # TorchFunctionMode), so give fused_softmax's imported names CPU versions (also cached: no per-layer
    # re-allocation).
    from megatron.core.fusions import fused_softmax

    fused_softmax.get_default_causal_mask = _cpu_default_causal_mask
    fused_softmax.get_sliding_window_causal_mask = _cpu_sliding_window_causal_mask


# --------------------------------------------------------------------------------------------------------
# 3. te_general_gemm NameError in the MoE router
# --------------------------------------------------------------------------------------------------------
@_shim("te_general_gemm")
def _apply_te_general_gemm():
    """Bind moe_utils.te_general_gemm = None (NameError in RouterGatingLinearFunction without TE)."""
    # The one megatron-core fix every machine without TE needs (GPUs too): applied here as well so that a CPU
    # process that only calls apply_cpu_shims() trains.
    from megatron_mech.adapters.megatron_core.fixes import bind_te_general_gemm

    bind_te_general_gemm()


# --------------------------------------------------------------------------------------------------------
# 4. CUDA stream in the alltoall token dispatcher
# --------------------------------------------------------------------------------------------------------
class _NoStream:
    """Stands in for ``MoEAlltoAllTokenDispatcher.cuda_dtoh_stream`` (a ``torch.cuda.Stream``) on the CPU."""

    def wait_stream(self, stream):
        return None

    def wait_event(self, event):
        return None

    def record_event(self, event=None):
        return self

    def synchronize(self):
        return None

    def query(self):
        return True


def _cpu_maybe_dtoh_and_synchronize(self, point, tokens_per_expert=None):
    # CPU replacement of MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize: nothing to copy or wait for;
    # only the conversion the GPU path does at the DtoH point (split sizes -> numpy) is kept, so the
    # all-to-all and gather/scatter calls receive the same types as on GPU.
    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        for attr in ("input_splits", "output_splits", "output_splits_tp"):
            value = getattr(self, attr)
            if torch.is_tensor(value):
                setattr(self, attr, value.numpy())
    return tokens_per_expert


@_shim("alltoall_stream")
def _apply_alltoall_stream():
    """Placeholder DtoH stream for the alltoall dispatcher (token_dispatcher.py torch.cuda.Stream())."""
    # transformer/moe/token_dispatcher.py MoEAlltoAllTokenDispatcher.__init__ creates a class-level
    # `torch.cuda.Stream()` ("torch.cuda.Stream requires CUDA support"), and _maybe_dtoh_and_synchronize uses
    # torch.cuda.current_stream()/torch.cuda.stream() inside the forward.
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    if MoEAlltoAllTokenDispatcher.cuda_dtoh_stream is None:
        MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = _NoStream()
    MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = _cpu_maybe_dtoh_and_synchronize


_CPU_STREAM = _NoStream()


def _cpu_current_stream(device=None) -> _NoStream:
    return _CPU_STREAM


@_shim("current_stream", needed_from="0.19")
def _apply_current_stream():
    """torch.cuda.current_stream() returns a placeholder stream (param_and_grad_buffer.py start_grad_sync, 0.19)."""
    # megatron-core 0.19 distributed/param_and_grad_buffer.py _ParamAndGradBucketGroup.start_grad_sync calls
    # `torch.cuda.current_stream()` on every grad sync, to wait on CUDA-graph replay events
    # ("Torch not compiled with CUDA enabled" in finalize_model_grads); earlier releases reach it only with
    # overlapped or multi-instance reduction. There are no CUDA graphs or streams on the CPU: the placeholder's
    # waits are no-ops, which is exact for synchronous CPU work.
    torch.cuda.current_stream = _cpu_current_stream


# --------------------------------------------------------------------------------------------------------
# 5. torch norms under sequence parallelism
# --------------------------------------------------------------------------------------------------------
@_shim("torch_norm_sp")
def _apply_torch_norm_sp():
    """Torch LayerNorm/RMSNorm under sequence parallelism (torch_norm.py asserts it off; MoE+TP needs it)."""
    # transformer/torch_norm.py WrappedTorchNorm asserts `not config.sequence_parallel` (the apex/TE norms
    # support it), but transformer/moe/moe_layer.py refuses to train with TP > 1 without sequence parallel.
    # A norm is per-token, so it works on a sequence shard as is; only its weight gradients are partial sums
    # over the local shard. Build it with SP off and mark its params `sequence_parallel=True` (what
    # FusedLayerNorm/TENorm do): finalize_model_grads then all-reduces them over TP.
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    original_new = WrappedTorchNorm.__new__

    def __new__(cls, config, hidden_size, *args, **kwargs):
        if not config.sequence_parallel:
            return original_new(cls, config, hidden_size, *args, **kwargs)
        no_sp = copy.copy(config)
        no_sp.sequence_parallel = False
        norm = original_new(cls, no_sp, hidden_size, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    WrappedTorchNorm.__new__ = staticmethod(__new__)


# --------------------------------------------------------------------------------------------------------
# 6. uneven all_gather / reduce_scatter on gloo
# --------------------------------------------------------------------------------------------------------
def _padded_gather_along_first_dim(original, input_, group, output_split_sizes=None, use_global_buffer=False):
    if output_split_sizes is None or group is None or group.size() == 1:
        return original(input_, group, output_split_sizes, use_global_buffer)
    # gloo's all_gather needs equal sizes: pad every rank's chunk to the largest, gather, drop the padding.
    sizes = [int(s) for s in output_split_sizes]
    world, longest = group.size(), max(sizes)
    chunk = input_.contiguous()
    if chunk.size(0) < longest:
        pad = chunk.new_zeros((longest - chunk.size(0),) + tuple(chunk.shape[1:]))
        chunk = torch.cat([chunk, pad], dim=0)
    gathered = chunk.new_empty((world * longest,) + tuple(chunk.shape[1:]))
    torch.distributed.all_gather_into_tensor(gathered, chunk, group=group)
    return torch.cat([gathered[r * longest: r * longest + sizes[r]] for r in range(world)], dim=0)


def _allreduce_reduce_scatter_along_first_dim(original, input_, group, input_split_sizes=None,
                                              use_global_buffer=False):
    if input_split_sizes is None or group is None or group.size() == 1:
        return original(input_, group, input_split_sizes, use_global_buffer)
    # gloo has no list reduce_scatter: all-reduce the whole tensor and keep this rank's slice.
    sizes = [int(s) for s in input_split_sizes]
    rank = group.rank()
    total = input_.contiguous().clone()
    torch.distributed.all_reduce(total, group=group)
    start = sum(sizes[:rank])
    return total[start: start + sizes[rank]].clone()


@_shim("uneven_gather")
def _apply_uneven_gather():
    """gloo all_gather/reduce_scatter with uneven splits (tensor_parallel/mappings.py, alltoall dispatcher)."""
    # tensor_parallel/mappings.py _gather_along_first_dim / _reduce_scatter_along_first_dim with
    # output/input_split_sizes call torch.distributed.all_gather / reduce_scatter on a list of unequal
    # chunks; the alltoall dispatcher does this over the expert-TP group when expert_tensor_parallel > 1.
    # gloo supports neither. Pad + all_gather_into_tensor + slice; all_reduce + slice. The even-size paths
    # are left to megatron. The autograd Functions in mappings.py look these names up at call time.
    from megatron.core.tensor_parallel import mappings

    mappings._gather_along_first_dim = functools.partial(
        _padded_gather_along_first_dim, mappings._gather_along_first_dim)
    mappings._reduce_scatter_along_first_dim = functools.partial(
        _allreduce_reduce_scatter_along_first_dim, mappings._reduce_scatter_along_first_dim)


# --------------------------------------------------------------------------------------------------------
# 7. gradient clipping
# --------------------------------------------------------------------------------------------------------
def _cpu_clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
    # optimizer/clip_grads.py clip_grad_by_total_norm_fp32 without `assert param.grad.type() ==
    # 'torch.cuda.FloatTensor'` and the multi-tensor-applier dummy buffer; one _foreach_mul_ does the scaling.
    from megatron.core.utils import to_local_if_dtensor

    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = []
    for param in parameters:
        grad = getattr(param, "decoupled_grad", None) if use_decoupled_grad else param.grad
        if grad is not None:
            grads.append(to_local_if_dtensor(grad).detach())
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0 and grads:
        torch._foreach_mul_(grads, clip_coeff)


def float64_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor=False, *args):
    """Drop-in for megatron's ``local_multi_tensor_l2_norm`` (the no-apex path of ``get_grad_norm_fp32``) that
    accumulates in float64: ``sqrt(Σ_tensors Σ_elements g²)``, each tensor cast to float64 before its norm.

    Returns ``(norm [1] float64, None)``. Megatron's version takes fp32 ``torch.norm`` per tensor and combines
    them in fp32: ~3e-5 relative error on a random 786k-element tensor and ~3e-4 on a real embedding gradient,
    enough to make clipped TP=2 and TP=1 runs drift apart. The float64 result also makes the cross-rank sum
    of squares (megatron all-reduces ``norm**2``) a float64 sum.
    """
    if per_tensor:
        raise NotImplementedError("per-tensor norms are not used by get_grad_norm_fp32")
    total = torch.zeros((), dtype=torch.float64)
    for tensor_list in tensor_lists:
        for tensor in tensor_list:
            total += torch.linalg.vector_norm(tensor.detach(), dtype=torch.float64).square().cpu()
    return total.sqrt().reshape(1), None


@_shim("clip_grads")
def _apply_clip_grads():
    """Gradient clipping without the CUDA type assert (optimizer/clip_grads.py clip_grad_by_total_norm_fp32),
    and a float64 grad norm where megatron falls back to its local fp32 one (no apex)."""
    # optimizer/clip_grads.py:167 `assert param.grad.type() == 'torch.cuda.FloatTensor'` fails for CPU grads
    # whenever clip_grad > 0. Replaced in clip_grads and in optimizer/optimizer.py, which imported the name.
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as moptimizer
    from megatron.core.utils import local_multi_tensor_l2_norm

    clip_grads.clip_grad_by_total_norm_fp32 = _cpu_clip_grad_by_total_norm_fp32
    moptimizer.clip_grad_by_total_norm_fp32 = _cpu_clip_grad_by_total_norm_fp32
    if getattr(clip_grads, "l2_norm_impl", None) is local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = float64_l2_norm


# --------------------------------------------------------------------------------------------------------
# The releases the shims are tested on (tests/integration/megatron_core/test_megatron_cpu.py and the rest of the
# suite on the first, tests/integration/megatron_core/test_megatron_versions.py trains on the others); other patch
# releases of these minors are expected to work.
TESTED_MEGATRON_CORE = ("0.16.1", "0.17.1", "0.18.2", "0.19.2")


def _minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def _check_megatron_version() -> None:
    import megatron.core  # noqa: F401  (ImportError here, before anything is patched)

    try:
        from importlib.metadata import version

        found = version("megatron-core")
    except Exception:  # source checkout without metadata
        found = getattr(getattr(megatron.core, "package_info", None), "__version__", "unknown")
    if _minor(found) not in {_minor(v) for v in TESTED_MEGATRON_CORE}:
        import warnings

        warnings.warn(f"megatron_cpu shims were tested on megatron-core {', '.join(TESTED_MEGATRON_CORE)}; "
                      f"found {found}: some patched names may differ", RuntimeWarning, stacklevel=3)


def apply_cpu_shims(only: Optional[Iterable[str]] = None, exclude: Iterable[str] = ()) -> List[str]:
    """Apply the CPU shims (all of ``SHIMS``, or ``only``, minus ``exclude``) not applied yet.

    Returns the names applied by this call, in application order: ``[]`` when CUDA is available (nothing
    is patched on a GPU machine) or when everything requested is already applied. Call it in every process
    before building megatron objects; it imports megatron-core lazily.
    """
    wanted = list(SHIMS) if only is None else list(only)
    excluded = set(exclude)
    unknown = (set(wanted) | excluded) - set(SHIMS)
    if unknown:  # checked on GPU machines too, so a typo does not hide until the first CPU run
        raise ValueError(f"unknown CPU shim(s) {sorted(unknown)}; known: {list(SHIMS)}")
    if torch.cuda.is_available():
        return []
    if not _APPLIED:
        _check_megatron_version()  # before patching anything: fail early if megatron-core is missing
    applied = []
    for name in SHIMS:  # registry order, whatever the order of `only`
        if name in wanted and name not in excluded and name not in _APPLIED:
            SHIMS[name].apply()
            _APPLIED.append(name)
            applied.append(name)
    return applied


def applied_cpu_shims() -> Tuple[str, ...]:
    """Names of the shims applied in this process so far."""
    return tuple(_APPLIED)
