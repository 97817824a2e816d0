"""The MoLS object for megatron-core, :class:`MegatronMoLS`: measures during the estimation window, feeds the
estimator, writes each step's multipliers.

The extra-sample reference (``--mech-mols-estimator samples``)
---------------------------------------------------------------
``sample_step(...)`` runs, at each window step, K = ``--mech-mols-samples`` extra forward/backward passes on
K separate micro-batches (the caller's iterator) through the real schedule with ``force_all_reduce=True``, keeps
each pass's per-key gradient (K copies of the gradient: expensive, a reference only), and feeds
:func:`megatron_mech.core.snr.sample_snr` (``batch_size = micro-batch × DP``); its additive components are summed over
ranks. It costs K extra forward/backward per window step, consumes dropout RNG, and leaves the grad buffers dirty
(call it before ``zero_grad_buffer``).
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

import torch

from megatron_mech.adapters.megatron_core.mols.grad_norms import KEY_INDEX, KEYS, NUM_KEYS, GradNormReader
from megatron_mech.adapters.megatron_core.mols.param_groups import (
    TAG,
    apply_multipliers,
    build_taxonomy,
    mols_config_overrides,
    protect_param_group_identity,
    record_bases,
)
from megatron_mech.core.mols import STATE_VERSION, MoLSConfig, MoLSController
from megatron_mech.core.snr import sample_snr
from megatron_mech.core.taxonomy import MODULE_CLASSES, ModuleTaxonomy
from megatron_mech.optim import param_groups

__all__ = ["MegatronMoLS", "ROUTES", "add_mols_arguments"]

logger = logging.getLogger(__name__)

ROUTES = ("auto", "dp", "microbatch")
_SAMPLE_PASSES = "_mols_sample_passes"  # attribute of the model config: > 0 while extra-sample passes run


def add_mols_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``--mech-mols*`` flags alone (generated from :class:`megatron_mech.config.MoLSOptions`; usable
    inside Megatron-LM's ``extra_args_provider``)."""
    from megatron_mech.config import MoLSOptions
    from megatron_mech.options import add_section_flags

    add_section_flags(parser.add_argument_group("megatron-mech MoLS (module-wise lr scaling from gradient SNR)"),
                      MoLSOptions)
    return parser


class _DisabledMoLS:
    """What :meth:`MegatronMoLS.from_args` returns without ``--mech-mols``: every method is a no-op."""

    enabled = False
    config_overrides = None

    def install(self, *a, **k):
        return self

    def wrap_forward_step(self, fn):
        return fn

    def sample_step(self, *a, **k):
        return False

    def before_scheduler_step(self, *a, **k):
        return None

    def apply(self, *a, **k):
        return None

    def metrics(self, *a, **k):
        return {}

    def table(self, *a, **k):
        return ""

    seconds = 0.0

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        return None


class MegatronMoLS:
    """MoLS for a megatron-core model: see the module docstring for the call order.

    Args:
        config: :class:`megatron_mech.core.mols.MoLSConfig` (``window_steps`` set).
        model_chunks: the DDP-wrapped model chunks (``[model]``).
        optimizer_config: the ``OptimizerConfig`` passed to ``get_megatron_optimizer``.
        global_batch_size, micro_batch_size: in sequences (``B_big`` and the micro-batch route's ``B_small``).
        taxonomy: a :class:`~megatron_mech.core.taxonomy.ModuleTaxonomy` of these chunks (default: built here).
        route: ``"auto"`` | ``"dp"`` | ``"microbatch"`` — small-batch source of the two-batch estimator.
        log: callable for the table printed when the estimate completes (default: ``print`` on global rank 0).

    Construction is collective (one world all-reduce of per-class counts): call it on every rank.
    """

    enabled = True

    def __init__(self, config: MoLSConfig, model_chunks: Sequence[torch.nn.Module], optimizer_config,
                 *, global_batch_size: int, micro_batch_size: int, taxonomy: Optional[ModuleTaxonomy] = None,
                 route: str = "auto", log: Optional[Callable[[str], None]] = None):
        from megatron.core import parallel_state as ps
        from megatron.core.utils import get_model_config

        if route not in ROUTES:
            raise ValueError(f"route must be one of {ROUTES}, got {route!r}")
        self.model_chunks = list(model_chunks)
        self.optimizer_config = optimizer_config
        self.model_config = get_model_config(self.model_chunks[0])
        self.taxonomy = taxonomy if taxonomy is not None else build_taxonomy(self.model_chunks)
        self.global_batch_size, self.micro_batch_size = int(global_batch_size), int(micro_batch_size)
        self.dp = ps.get_data_parallel_world_size()
        self.edp = ps.get_expert_data_parallel_world_size()
        self.pp = ps.get_pipeline_model_parallel_world_size()
        self.cp = ps.get_context_parallel_world_size()
        if self.global_batch_size % (self.micro_batch_size * self.dp):
            raise ValueError(f"global batch {global_batch_size} is not divisible by micro-batch × DP = "
                             f"{micro_batch_size} × {self.dp}")
        self.num_microbatches = self.global_batch_size // (self.micro_batch_size * self.dp)
        self._reader = GradNormReader(self.model_chunks, self.taxonomy, self.model_config)
        presence = self._reader.presence().to(self._reader.device)
        torch.distributed.all_reduce(presence)
        presence = presence.cpu()
        self.dense_keys = {k for k in KEYS if presence[0, KEY_INDEX[k]] > 0}
        self.expert_keys = {k for k in KEYS if presence[1, KEY_INDEX[k]] > 0}
        mixed = sorted(self.dense_keys & self.expert_keys)
        if mixed:
            raise ValueError(f"module key(s) {mixed} hold both expert-parallel and dense parameters; their small "
                             "batches differ, so MoLS cannot estimate them (map them with taxonomy extra_rules)")
        self.keys = [k for k in KEYS if k in self.dense_keys | self.expert_keys]
        classes_present = [c for c in MODULE_CLASSES if presence[3, KEY_INDEX[c]] > 0]
        fused = None
        if presence[2, 0] > 0:
            cfg = self.model_config
            fused = (cfg.num_attention_heads, cfg.num_query_groups or cfg.num_attention_heads)
        if config.window_steps is None:
            raise ValueError("MoLSConfig.window_steps must be set (MegatronMoLS.from_args uses 1% of train iters)")
        self.controller = MoLSController(config, classes_present=classes_present, fused_qkv=fused)
        self.config = config
        self.group_classes = tuple(classes_present)
        self.route = None
        if config.estimator == "two_batch":
            self.route = self._choose_route(route)
        # the micro-batch route's snapshot: when this forward starts, exactly micro-batch 1's backward has run
        # on this stage (1F1B: the stage's warm-up forwards, then forward, backward alternate; 2 without PP)
        stage = ps.get_pipeline_model_parallel_rank() if self.pp > 1 else 0
        self._snapshot_forward = min(self.pp - stage - 1, self.num_microbatches) + 2
        self._log = log if log is not None else logger.info
        self._step = 1  # the step in progress / next to run (counted from 1); install(step=...), load_state_dict
        self._fwd_count = 0
        self._snap = None
        self._observed_step = None
        self._finalize_wrapper = None
        self.optimizer = None
        self.last_observation: Optional[dict] = None
        self._config_overrides = None
        self.seconds = 0.0  # wall time spent measuring and applying (overhead accounting, benchmarks)
        self.diagnostic_seconds = 0.0  # wall time of the post-window diagnostic (report only; not in seconds)

    # -- construction helpers
    @classmethod
    def from_args(cls, args, model_chunks, optimizer_config, taxonomy=None, log=None):
        """Build from parsed arguments (``--mech-mols*`` plus Megatron's ``--train-iters``/``--train-samples``,
        ``--lr-warmup-iters``/``-samples``/``-fraction``, ``--global-batch-size``, ``--micro-batch-size``).
        Returns a no-op object when ``--mech-mols`` is not given."""
        from megatron_mech.adapters.megatron_core.megatron_args import lr_warmup_steps, train_steps
        from megatron_mech.config import MoLSOptions
        from megatron_mech.options import section_from_flags

        options = section_from_flags(MoLSOptions, args)
        if not options.enabled:
            return _DisabledMoLS()
        config = options.core_config(train_steps=train_steps(args), ramp_end=lr_warmup_steps(args))
        return cls(config, model_chunks, optimizer_config, global_batch_size=int(args.global_batch_size),
                   micro_batch_size=int(args.micro_batch_size), taxonomy=taxonomy, log=log)

    def _choose_route(self, route: str) -> str:
        cfg = self.model_config
        hint = " (or use --mech-mols-estimator samples)"
        if getattr(cfg, "calculate_per_token_loss", False):
            raise ValueError("MoLS two_batch estimator: calculate_per_token_loss normalises gradients by the global "
                             "token count only after the DP reduction, so the local gradient's batch is unknown"
                             + hint)
        if self.cp > 1:
            raise ValueError("MoLS two_batch estimator: context parallelism splits sequences, not examples, across "
                             "the data-parallel group" + hint)
        overlap = bool(getattr(self.model_chunks[0].ddp_config, "overlap_grad_reduce", False))
        need_dp = [self.dp] + ([self.edp] if self.expert_keys else [])
        can_dp = min(need_dp) > 1 and not overlap
        # 1F1B runs (PP - stage - 1) warm-up forwards before the first backward: the snapshot needs one more
        # forward after it on every stage, so PP + 1 micro-batches (2 without PP); no interleaved schedule
        can_micro = self.num_microbatches >= self.pp + 1 and (self.pp == 1 or len(self.model_chunks) == 1)
        if route == "auto":
            route = "dp" if can_dp else "microbatch" if can_micro else None
        if route == "dp" and not can_dp:
            raise ValueError(f"MoLS route 'dp' needs DP > 1 (and expert-DP > 1 with MoE experts) and "
                             f"overlap_grad_reduce=False; here DP={self.dp}, expert-DP={self.edp}, overlap={overlap}")
        if route == "microbatch" and not can_micro:
            raise ValueError(f"MoLS route 'microbatch' needs >= PP + 1 micro-batches per step (>= 2 without "
                             f"pipeline parallelism) and no interleaved pipeline schedule; here "
                             f"{self.num_microbatches} micro-batch(es), PP={self.pp}, "
                             f"{len(self.model_chunks)} model chunk(s)")
        if route is None:
            why = (f"overlap_grad_reduce=True hides the local gradient at finalize, and with "
                   f"{self.num_microbatches} micro-batch(es) per step there is no micro-batch snapshot" if overlap
                   else f"DP={self.dp}{f', expert-DP={self.edp}' if self.expert_keys else ''} gives no small/big "
                        f"batch pair and {self.num_microbatches} micro-batch(es) per step (PP={self.pp}) give none "
                        f"either")
            raise ValueError("MoLS two_batch estimator needs a small and a big batch: " + why
                             + "; use DP > 1 or gradient accumulation (>= PP + 1 micro-batches)" + hint)
        return route

    @property
    def config_overrides(self) -> Dict:
        """Pass as ``get_megatron_optimizer(..., config_overrides=mols.config_overrides)``."""
        if self._config_overrides is None:
            self._config_overrides = mols_config_overrides(self.model_chunks, self.optimizer_config, self.taxonomy)
        return self._config_overrides

    @property
    def _suspended(self) -> bool:
        return getattr(self.model_config, _SAMPLE_PASSES, 0) > 0

    @contextlib.contextmanager
    def _suspend(self):
        """The reference estimator's sample passes run through the same schedule, so every MoLS wrapper on this
        model passes through meanwhile — also those of another MoLS object on the same model (a reference run
        next to the estimator it checks). The count lives on the model's config, the object the wrappers share."""
        setattr(self.model_config, _SAMPLE_PASSES, getattr(self.model_config, _SAMPLE_PASSES, 0) + 1)
        try:
            yield
        finally:
            setattr(self.model_config, _SAMPLE_PASSES, getattr(self.model_config, _SAMPLE_PASSES) - 1)

    # -- installation
    def attach(self, optimizer) -> MegatronMoLS:
        """:meth:`install` into the model's own config (the one ``forward_backward_func`` reads)."""
        return self.install(self.model_config, optimizer)

    def install(self, model_config, optimizer, step: Optional[int] = None) -> MegatronMoLS:
        """Attach to the optimizer and the model config: protect the param-group identity for checkpoint loads,
        wrap ``model_config.finalize_model_grads_func`` (two_batch; megatron's ``finalize_model_grads`` if unset)
        and write the multipliers of ``step`` (default: the next step to run, 1 for a fresh run).
        Call after ``get_megatron_optimizer`` and after setting ``finalize_model_grads_func``, before loading
        optimizer state and before building the scheduler."""
        untagged = [g for g in param_groups(optimizer) if g.get("params") and TAG not in g]
        if untagged:
            raise ValueError(f"{len(untagged)} optimizer param group(s) carry no {TAG!r} tag: build the optimizer "
                             "with get_megatron_optimizer(..., config_overrides=mols.config_overrides)")
        self.optimizer = optimizer
        protect_param_group_identity(optimizer)
        scaled = set(self.controller.scaled_classes(self.group_classes))
        for g in param_groups(optimizer):
            record_bases(g)
            if "default_config" in g and g.get(TAG) in scaled and g.get(TAG) != self.config.base:
                g["default_config"] = False  # Megatron-LM logs the lr of the first default_config group
        if self.config.estimator == "two_batch" and self._finalize_wrapper is None:
            real = model_config.finalize_model_grads_func
            if real is None:
                from megatron.core.distributed import finalize_model_grads as real
            self._finalize_wrapper = self._make_finalize(real)
            model_config.finalize_model_grads_func = self._finalize_wrapper
        self.model_config = model_config
        if step is not None:
            self._step = int(step)
        self.apply(self._step)
        return self

    def wrap_finalize_model_grads(self, model_config) -> None:
        """Measure around ``model_config.finalize_model_grads_func`` again after the trainer replaced it
        (Megatron-LM's ``train`` sets it after the optimizer is built); two_batch only, and a function MoLS
        already wraps is left as it is."""
        if self.config.estimator != "two_batch":
            return
        current = model_config.finalize_model_grads_func
        if not getattr(current, "_mols_real", None):
            self._finalize_wrapper = self._make_finalize(current)
            model_config.finalize_model_grads_func = self._finalize_wrapper
        self.model_config = model_config

    def apply(self, step: int) -> None:
        """Write the multipliers of ``step`` into the param groups (effective at the scheduler's next step)."""
        if self.optimizer is None:
            return
        c = self.controller
        mults = {cls: c.multiplier(step, cls) for cls in self.group_classes}
        wd = None if self.config.scale_weight_decay else {
            cls: c.wd_multiplier(step, cls) for cls in self.group_classes}
        apply_multipliers(self.optimizer, mults, wd_multipliers=wd)

    # -- statistics
    def wrap_forward_step(self, forward_step_func: Callable) -> Callable:
        """Count forward calls per step and, on the micro-batch route during the window, snapshot the local
        per-key squared norms when the forward after micro-batch 1's backward starts (the 2nd forward of a step;
        under 1F1B pipelining the stage's warm-up forwards come first). Evaluation forwards (under ``no_grad`` or
        with the model in eval mode) are ignored. Returns the function unchanged when no snapshot is needed."""
        if self.config.estimator != "two_batch" or self.route != "microbatch":
            return forward_step_func

        @functools.wraps(forward_step_func)
        def forward_step(*args, **kwargs):
            model = args[1] if len(args) > 1 else kwargs.get("model")
            if self._suspended or not torch.is_grad_enabled() or not getattr(model, "training", True):
                return forward_step_func(*args, **kwargs)
            self._fwd_count += 1
            if self._fwd_count == self._snapshot_forward and self._measuring(self._step):
                started = time.perf_counter()
                self._snap = self._reader.local("pre")
                self._account(self._step, time.perf_counter() - started)
            return forward_step_func(*args, **kwargs)

        forward_step._mols_wrapped = True
        return forward_step

    def _make_finalize(self, real: Callable) -> Callable:
        @functools.wraps(real)
        def finalize_model_grads(*args, **kwargs):
            if self._suspended:
                return real(*args, **kwargs)
            step = self._step
            active = self._measuring(step)
            started = time.perf_counter()
            pre = self._reader.local("pre") if active and self.route == "dp" else None
            self._account(step, time.perf_counter() - started)
            out = real(*args, **kwargs)
            if active:
                started = time.perf_counter()
                self._observe(step, pre)
                self._account(step, time.perf_counter() - started)
            self._fwd_count, self._snap = 0, None
            return out

        finalize_model_grads._mols_real = real
        return finalize_model_grads

    def _account(self, step: int, seconds: float) -> None:
        if self.controller.in_window(step) or not self.controller.in_diagnostic(step):
            self.seconds += seconds
        else:
            self.diagnostic_seconds += seconds

    def _measuring(self, step: int) -> bool:
        """Gradient statistics are taken at window steps and at post-window diagnostic steps."""
        return self.controller.in_window(step) or self.controller.in_diagnostic(step)

    def _observe(self, step: int, pre) -> None:
        r = self._reader
        if self.route == "microbatch":
            small, ok, num_micro = self._snap, 1.0, self._fwd_count
            if small is None:  # no snapshot on this rank: join the collectives with zeros, skip the step below
                ok = 0.0
                small = (torch.zeros(2, NUM_KEYS, dtype=torch.float64, device=r.device), r.zero_partials())
        else:
            small, ok, num_micro = pre, 1.0, self.num_microbatches
        post, _ = r.local("post")
        small_c = r.add_partials(*small)
        vec = torch.cat([small_c.reshape(-1), post.reshape(-1), torch.tensor([ok, float(max(num_micro, 0))],
                                                                              dtype=torch.float64,
                                                                              device=r.device)])
        torch.distributed.all_reduce(vec)
        vec = vec.cpu()
        world = torch.distributed.get_world_size()
        if vec[-2].item() < world:  # some rank took no snapshot (e.g. 1 micro-batch this step): skip the step
            self._observed_step = step
            return
        num_micro = int(round(vec[-1].item() / world))
        if self.route == "microbatch" and num_micro < 2:
            self._observed_step = step
            return
        small_c = vec[:2 * NUM_KEYS].view(2, NUM_KEYS)
        post = vec[2 * NUM_KEYS:4 * NUM_KEYS].view(2, NUM_KEYS)
        ls = 1.0
        if self.optimizer is not None and hasattr(self.optimizer, "get_loss_scale"):
            ls = float(self.optimizer.get_loss_scale())
        ls2 = ls * ls
        B = self.micro_batch_size * num_micro * self.dp
        small_n, big_n, small_b = {}, {}, {}
        for k in self.keys:
            expert = k in self.expert_keys
            row, rdp = (1, self.edp) if expert else (0, self.dp)
            post_div = rdp / r.shards[expert] if r.dist_opt else rdp
            factor = (self.edp / self.dp) ** 2 if expert else 1.0
            if self.route == "microbatch":
                factor *= num_micro ** 2
                small_b[k] = self.micro_batch_size * self.dp / rdp
            else:
                small_b[k] = B / rdp
            small_n[k] = small_c[row, KEY_INDEX[k]].item() / rdp * factor / ls2
            big_n[k] = post[row, KEY_INDEX[k]].item() / post_div / ls2
        self.last_observation = {"step": step, "small": small_n, "big": big_n, "small_batch": small_b,
                                 "big_batch": B, "route": self.route}
        if not self.controller.in_window(step):  # a diagnostic step: reported, multipliers unchanged
            self.controller.observe_diagnostic(step, small_n, big_n, small_b, B)
            self._observed_step = step
            return
        was_done = self.controller.done
        self.controller.observe(step, small_n, big_n, small_b, B)
        self._observed_step = step
        if self.controller.done and not was_done:
            self._announce()

    def _announce(self) -> None:
        self._log(self.controller.table(self.controller.window_end + 1))  # the first step after the window

    # -- the reference estimator
    def sample_step(self, step: int, forward_backward_func: Callable, forward_step_func: Callable,
                    data_iterator, *, seq_length: int, micro_batch_size: Optional[int] = None,
                    **forward_backward_kwargs) -> bool:
        """The ``samples`` estimator: at a window step, run K extra forward/backward passes (one
        micro-batch each, drawn from ``data_iterator``, all-reduced over DP) and feed
        :func:`megatron_mech.core.snr.sample_snr`. No-op (False) otherwise. Call before ``zero_grad_buffer()`` of the
        training step: it leaves the grad buffers holding the last sample. It clears ``param.grad`` before each
        pass (megatron's FP32Optimizer leaves it aliased to ``main_grad`` after ``step()``)."""
        if self.config.estimator != "samples" or not self.controller.in_window(step):
            return False
        mbs = int(micro_batch_size or self.micro_batch_size)
        r = self._reader
        samples: Dict[str, List[torch.Tensor]] = {}
        ls = float(self.optimizer.get_loss_scale()) if self.optimizer is not None and hasattr(
            self.optimizer, "get_loss_scale") else 1.0
        with self._suspend():
            for _ in range(self.config.num_samples):
                for chunk in self.model_chunks:
                    chunk.zero_grad_buffer()
                    # megatron's FP32Optimizer leaves param.grad aliased to param.main_grad after step(); a
                    # backward before the training step's optimizer.zero_grad() would then count the gradient twice
                    for param in chunk.parameters():
                        param.grad = None
                forward_backward_func(forward_step_func=forward_step_func, data_iterator=data_iterator,
                                      model=self.model_chunks, num_microbatches=1, seq_length=seq_length,
                                      micro_batch_size=mbs, forward_only=False, force_all_reduce=True,
                                      **forward_backward_kwargs)
                for k, v in r.vectors().items():
                    samples.setdefault(k, []).append(v / ls)
        comp = torch.zeros(2, NUM_KEYS, 2, dtype=torch.float64)
        for k, vs in samples.items():
            if vs[0].numel() == 0:
                continue
            est = sample_snr(torch.stack(vs), batch_size=mbs * self.dp)
            row = 1 if k in self.expert_keys else 0
            comp[row, KEY_INDEX[k], 0] += est.grad_sq
            comp[row, KEY_INDEX[k], 1] += est.trace_cov
        comp = comp.to(r.device)
        torch.distributed.all_reduce(comp)
        comp = comp.cpu()
        out = {}
        for k in self.keys:
            row, rdp = (1, self.edp) if k in self.expert_keys else (0, self.dp)
            out[k] = (comp[row, KEY_INDEX[k], 0].item() / rdp, comp[row, KEY_INDEX[k], 1].item() / rdp)
        self.last_observation = {"step": int(step), "components": out, "batch": mbs * self.dp}
        was_done = self.controller.done
        self.controller.observe_estimates(step, out)
        if self.controller.done and not was_done:
            self._announce()
        return True

    # -- per step
    def before_scheduler_step(self, step: Optional[int] = None) -> None:
        """After ``optimizer.step()`` of ``step`` and before ``scheduler.step()``: complete the estimate at the
        window end and write the multipliers of ``step + 1``."""
        step = self._step if step is None else int(step)
        if (self.config.estimator == "two_batch" and self.controller.in_window(step)
                and self._observed_step != step):
            raise RuntimeError(f"MoLS: no gradient statistics were taken for step {step}: the finalize wrapper "
                               "did not run (was config.finalize_model_grads_func replaced after mols.install()? "
                               f"is step={step} the step that just ran?)")
        started = time.perf_counter()
        if self.controller.maybe_finalize(step):
            self._announce()
        self._step = step + 1
        self.apply(self._step)
        self.seconds += time.perf_counter() - started

    # -- reporting and state
    @property
    def next_step(self) -> int:
        """The step whose multipliers are currently written (the next one to run)."""
        return self._step

    def metrics(self, step: Optional[int] = None) -> Dict[str, float]:
        """``controller.metrics`` at ``step`` (default: the next step, whose multipliers are live)."""
        return self.controller.metrics(self._step if step is None else step)

    def table(self, step: Optional[int] = None) -> str:
        return self.controller.table(self._step if step is None else step)

    def state_dict(self) -> Dict[str, Any]:
        """Plain types; identical on every rank (all estimates are all-reduced)."""
        return {"version": STATE_VERSION, "controller": self.controller.state_dict(), "next_step": self._step,
                "route": self.route}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore and, when installed, write the multipliers of the restored next step into the groups
        (so a scheduler loaded afterwards — or ``scheduler.step(0)`` — sets the same lrs as the saved run)."""
        if not state:
            return
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"MegatronMoLS state version {state.get('version')!r} was saved by another version of "
                             f"megatron-mech; this one reads version {STATE_VERSION} (steps counted from 1)")
        self.controller.load_state_dict(state["controller"])
        self._step = int(state["next_step"])
        self._fwd_count, self._snap = 0, None
        self.apply(self._step)
