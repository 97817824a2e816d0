"""What a framework adapter tells the hook about the model: a framework-neutral description.

A framework adapter (:mod:`megatron_mech.adapters.megatron_core.discovery` for megatron-core; the DeepSpeed and
Megatron-LM adapters alike) finds the attention layers, the MoE routers, the dense linears and the process groups and
hands them over as one :class:`ModelView`. The hook (:class:`megatron_mech.hook.MechHook`) never looks inside the
model itself. A family without a field of its own (a user's monitor, a new family) takes its inputs from
:attr:`ModelView.families`, under its name.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from megatron_mech.monitors.attention import AttentionLayer

__all__ = ["MASTER_WEIGHTS", "ModelView", "RouterView", "model_weights_words"]

MASTER_WEIGHTS = "the optimizer's float32 master weights"
"""The start line's words for the weights read with ``--mech-weights master`` where the optimizer keeps them."""


def model_weights_words(dtypes) -> str:
    """The start line's words for the model's own weights of ``dtypes``: 16-bit ones are the optimizer's rounded
    copies; 32- or 64-bit ones are what the optimizer updates (the master weights themselves)."""
    names = sorted({str(dtype).replace("torch.", "") for dtype in dtypes}) or ["float32"]
    own = "" if any(torch.finfo(dtype).bits <= 16 for dtype in dtypes) else " (the optimizer's own)"
    return f"the model's {'/'.join(names)} weights{own}"


@dataclass
class RouterView:
    """One MoE router on this rank."""

    layer: int
    """0-based global layer index (the index in the metric names)."""
    weight: torch.Tensor
    """The router weight ``[num_experts, d_model]`` (``[out, in]``, the framework's own parameter)."""
    topk: int
    """Experts per token."""
    capture: Callable[[Callable[[torch.Tensor], None]], None]
    """``capture(observe)`` installs ``observe``: the framework then calls ``observe(logits)`` with the full router
    logits ``[tokens, num_experts]`` (before top-k) of every micro-batch, and routes on those same logits.
    Installing twice must not observe twice. The hook's ``observe`` has a boolean ``capturing``, False between
    evaluation steps: the capture then skips it and does no tensor work."""


@dataclass
class ModelView:
    """The model as the monitors and MoLS see it, on one rank."""

    attention_layers: Sequence[AttentionLayer] = ()
    """This rank's self-attention layers (fused QKV weight shard, head counts, first global head), layer order."""
    routers: Sequence[RouterView] = ()
    """This rank's MoE routers, layer order (empty on a dense model or a rank without MoE layers)."""
    dense_linears: Mapping[str, tuple] = field(default_factory=dict)
    """``{"layer{L}/<name>": (weight shard [out, in], shard dim)}``: dense linears for ``--mech-all-linears``."""
    tp_group: Any = None
    """Tensor-parallel group of the attention weights (``None``: no TP)."""
    token_group: Any = None
    """The group over which routed tokens are split (DP, or TP×DP with sequence parallelism)."""
    dp_group: Any = None
    """Data-parallel replicas holding the same weights: the attention evaluation is shared out over them
    (``None``: no split)."""
    experts: Sequence[Any] = ()
    """This rank's MoE experts per layer (:class:`~megatron_mech.monitors.experts.ExpertLayer`), for
    ``--mech-experts``."""
    expert_group: Any = None
    """The ranks that together hold a layer's experts (EP × expert-TP), over which expert scalars are summed."""
    expert_dp_group: Any = None
    """Expert-data-parallel replicas holding the same experts: the expert evaluation is shared out over them
    (``None``: no split)."""
    pp_group: Any = None
    """Pipeline group when there is more than one stage (metrics are merged over it), else ``None``."""
    world_group: Any = None
    """The group over every rank, for what a monitor reduces over the whole run (``None``: the default group; the
    hook's evaluation worker gives its own duplicate, see :mod:`megatron_mech.hook.async_evaluation`)."""
    logging_rank: bool = True
    """Whether this rank writes the records (exactly one rank per run)."""
    attention_logit_capture: Sequence[Callable[[Callable[..., None]], None]] = ()
    """One ``capture(record)`` per self-attention layer on this rank (empty: the framework offers none). It
    installs ``record(layer, query [b, h, sq, d], key [b, g, sk, d], scale, causal, mask=None)``, called with the
    inputs of every forward of the layer's attention kernel (``scale``: the softmax scale applied to ``q·k``;
    ``mask``: bool, True = masked out). Installing twice must not record twice. The hook's ``record`` has a
    boolean ``capturing``, False between evaluation steps: the capture then returns before any tensor work. Feeds
    the max-attention-logit symptom (:mod:`megatron_mech.monitors.max_logit`)."""
    mols: Optional[Callable[..., Any]] = None
    """MoLS factory of this framework, ``mols(core_config, log=...) -> backend`` (``None``: MoLS unavailable).
    The backend offers ``config_overrides``, ``attach(optimizer)``, ``wrap_forward_step(fn)``,
    ``before_scheduler_step(step)``, ``metrics(step)``, ``seconds``, ``state_dict``/``load_state_dict``
    (see :class:`megatron_mech.adapters.megatron_core.mols.MegatronMoLS`)."""
    weights: str = ""
    """Which copy of the weights the tensors above are, in words for the start line (e.g. "the optimizer's
    float32 master weights"); set by :meth:`reading` (empty: not said)."""
    families: Mapping[str, Any] = field(default_factory=dict)
    """The inputs of a monitor family that has no field of its own above, by the family's name (e.g.
    ``{"activation_norms": model.decoder.layers}``): what a user's script or an adapter fills and that monitor reads
    in its ``setup``. :meth:`reading` leaves it as it is: a monitor reading weights from here reads them as given."""
    refresh_weights: Optional[Callable[[], None]] = None
    """Called by the hook on every rank at the same steps, right before the monitors copy the weights (their first
    snapshot and each evaluation step): brings up to date the weights the tensors above hold where they are a
    gathered copy rather than the optimizer's own tensors (collective; ``None``: nothing to do)."""

    def monitored_weights(self) -> list[torch.Tensor]:
        """Every weight tensor the monitors read, in the view's order (the same on every data-parallel replica):
        the attention QKV weights, the routers', the dense linears', the experts'."""
        return ([layer.qkv_weight for layer in self.attention_layers] + [router.weight for router in self.routers]
                + [weight for weight, _ in self.dense_linears.values()]
                + [m for layer in self.experts for mats in layer.experts for m in mats])

    def reading(self, read: Callable[[torch.Tensor], torch.Tensor], weights: str,
                refresh: Optional[Callable[[], None]] = None) -> ModelView:
        """This view with every monitored weight ``w`` (:meth:`monitored_weights`) replaced by ``read(w)``, a tensor
        of the same shape holding the same weights in another copy (e.g. the optimizer's float32 master weights);
        ``weights`` says which in words, ``refresh`` keeps them up to date (:attr:`refresh_weights`). The one place
        where the tensor each monitor reads is chosen."""
        def checked(w: torch.Tensor) -> torch.Tensor:
            copy = read(w)
            if tuple(copy.shape) != tuple(w.shape):
                raise ValueError(f"a monitored weight of shape {tuple(w.shape)} was given a copy of shape "
                                 f"{tuple(copy.shape)} ({weights})")
            return copy

        return dataclasses.replace(
            self,
            attention_layers=[dataclasses.replace(layer, qkv_weight=checked(layer.qkv_weight))
                              for layer in self.attention_layers],
            routers=[dataclasses.replace(router, weight=checked(router.weight)) for router in self.routers],
            dense_linears={name: (checked(weight), dim) for name, (weight, dim) in self.dense_linears.items()},
            experts=[dataclasses.replace(layer, experts=[[checked(m) for m in mats] for mats in layer.experts])
                     for layer in self.experts],
            weights=weights, refresh_weights=refresh)
