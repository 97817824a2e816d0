"""Attention discovery for HF-style models under DeepSpeed, and ZeRO-aware weight access.

Discovery
---------
* **Separate projections** (Llama, Mistral, Mixtral, Qwen2, Qwen2-MoE, …): a module with ``q_proj`` and
  ``k_proj`` linears. Weights ``[out, in]``: ``q_proj.weight`` ``[H·d_head, d_model]``, ``k_proj.weight``
  ``[G·d_head, d_model]``, rows ordered by head.
* **Fused QKV**: the modules of :data:`megatron_mech.core.taxonomy.FUSED_QKV_MODULES` — the same table MoLS
  classifies parameters with, so the monitors and MoLS agree: ``query_key_value`` (GPT-NeoX, Falcon: rows
  grouped per KV group, the Megatron layout), ``qkv_proj`` / ``Wqkv`` (Phi-3, MPT: ``[Q | K | V]``), ``c_attn``
  (GPT-2 ``Conv1D``, ``[in, out]``, ``[Q | K | V]`` columns).
* Heads ``H`` = ``config.num_attention_heads``, KV heads ``G`` = ``config.num_key_value_heads`` (default ``H``),
  ``d_head`` = ``config.head_dim`` or ``hidden_size / H``; the weight shapes are checked against them.
  The layer index is the module's ``layer_idx`` (HF attention modules carry it), else the position in
  discovery order.

Each layer becomes an :class:`~megatron_mech.monitors.attention.AttentionLayer` whose ``qkv_weight`` is a
buffer in the grouped fused layout (:func:`megatron_mech.core.layouts.grouped_qkv_from_blocks`) that
:meth:`HFAttention.refresh` fills from the live weights right before each snapshot/evaluation. Only the Q and
K rows are filled (the monitor reads nothing else; the V rows stay zero). Buffer: ``4·(H + 2G)·d_head·d_model``
bytes per layer on the weight's device (float32; float64 for float64 weights).

ZeRO weight access (what we chose and why)
------------------------------------------
* **ZeRO 0/1/2**: every data-parallel rank holds the full module weights (ZeRO-1/2 partition optimizer state
  and gradients, and all-gather the updated weights after each step). They are read directly: no collective.
  With bf16/fp16 training these are the 16-bit module weights, upcast exactly (the weights the model runs).
* **Master weights** (``mech.monitors.weights`` ``"master"``, the default) in bf16/fp16 training: the optimizer's
  float32 master copy (:func:`master_weight_reader`): ZeRO 0's whole copy on every rank, or the float32 partitions
  of ZeRO 1–3 gathered by ``deepspeed.utils.safe_get_full_fp32_param`` (a collective over the data-parallel
  group, issued by every rank in the same order), so ΔW carries no bf16 rounding. In float32 training the module
  weights are the master weights and are read as below.
* **ZeRO 3**: each rank holds a contiguous ``1/N`` slice of the *flattened* parameter (``param.ds_tensor``).
  The slice boundaries fall at arbitrary element offsets, not on rows or columns, so a rank holds partial
  rows, and the Gram ``ΔWᵀΔW = Σ_rows r rᵀ`` needs cross products of pieces held on different ranks: the
  shard-Gram path the tensor-parallel monitors use (whole rows per rank, one all-reduce) does not apply.
  So we gather: ``deepspeed.zero.GatheredParameters([q_proj.weight, k_proj.weight], modifier_rank=None)``
  per layer (read only, one layer's Q and K in memory at a time), only on steps that are multiples of the
  interval. Every rank issues these all-gathers in the same (discovery) order. The traffic is the Q and K
  weights once every δ steps, against every parameter twice per step in ZeRO-3's own forward/backward.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import re
import sys
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from megatron_mech.core.layouts import concatenated_qkv_blocks, grouped_qkv_from_blocks, qkv_partition_sizes
from megatron_mech.core.taxonomy import FUSED_QKV_MODULES
from megatron_mech.monitors.attention import AttentionLayer

__all__ = ["HFAttention", "AttentionGeometry", "attention_geometry", "find_hf_attention", "hf_attention_logit_captures",
           "is_zero3_param", "master_weight_reader", "read_weights"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AttentionGeometry:
    """Head counts of the model: ``num_heads`` H query heads, ``num_kv_heads`` G key/value heads, ``head_dim``."""

    num_heads: int
    num_kv_heads: int
    head_dim: int


def attention_geometry(model: torch.nn.Module, num_heads: Optional[int] = None, num_kv_heads: Optional[int] = None,
                       head_dim: Optional[int] = None) -> AttentionGeometry:
    """Head counts from the HF model config (``model.config``), with explicit values taking precedence."""
    config = getattr(model, "config", None)
    if num_heads is None:
        num_heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None)
    if num_heads is None:
        raise ValueError("attention monitors: the model has no config.num_attention_heads; pass num_heads")
    if num_kv_heads is None:
        num_kv_heads = getattr(config, "num_key_value_heads", None) or getattr(config, "num_kv_heads", None) \
            or num_heads
    if head_dim is None:
        head_dim = getattr(config, "head_dim", None)
        if head_dim is None:
            hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)
            if hidden is None:
                raise ValueError("attention monitors: the model config has neither head_dim nor hidden_size; "
                                 "pass head_dim")
            head_dim = hidden // num_heads
    qkv_partition_sizes(int(num_heads), int(num_kv_heads))
    return AttentionGeometry(int(num_heads), int(num_kv_heads), int(head_dim))


def is_zero3_param(p: torch.Tensor) -> bool:
    """True for a ZeRO-3 partitioned parameter (DeepSpeed sets ``ds_id``/``ds_status`` on them)."""
    return hasattr(p, "ds_id") and hasattr(p, "ds_status")


def _full_shape(p: torch.Tensor) -> tuple:
    return tuple(getattr(p, "ds_shape", p.shape))


def _gathered(params, enabled: bool):
    if not enabled:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(params), modifier_rank=None)


def master_weight_reader(engine) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
    """``read(param)``: the full float32 master weight of a module parameter, as the engine's optimizer keeps it
    (bf16/fp16 training); ``None`` when the engine keeps none apart from the module's (float32 training).

    ZeRO 0 (``FP16_Optimizer``, ``FP16_UnfusedOptimizer``, also used for bf16): every rank keeps a whole float32
    copy, read locally. ZeRO 1–3 and the bf16 optimizer: ``deepspeed.utils.safe_get_full_fp32_param`` (a
    collective over the data-parallel group where the copy is partitioned). Looked up at each read, so a
    checkpoint load that replaces the optimizer's tensors is followed."""
    if not (engine.bfloat16_enabled() or engine.fp16_enabled()):
        return None
    optimizer = engine.optimizer

    def read(param: torch.Tensor) -> torch.Tensor:
        replicated = _replicated_masters(optimizer)
        if replicated is not None:
            weight = replicated.get(param)
        else:
            from deepspeed.utils import safe_get_full_fp32_param

            weight = safe_get_full_fp32_param(param)
        if weight is None:
            raise ValueError(f"mech.monitors.weights 'master': the DeepSpeed optimizer ({type(optimizer).__name__}) "
                             f"keeps no float32 master copy of a monitored parameter; set it to 'model'")
        return weight

    return read


def _replicated_masters(optimizer) -> Optional[dict]:
    """``{param: float32 master}`` of ZeRO 0's 16-bit optimizers (whole copies on every rank), else ``None``."""
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    if isinstance(optimizer, FP16_UnfusedOptimizer):
        return {p: m for params, masters in zip(optimizer.fp16_groups, optimizer.fp32_groups)
                for p, m in zip(params, masters)}
    if isinstance(optimizer, FP16_Optimizer):   # one flat float32 copy per group, the params back to back
        found = {}
        for params, flat in zip(optimizer.fp16_groups, optimizer.fp32_groups_flat):
            offset = 0
            for p in params:
                found[p] = flat[offset:offset + p.numel()].view(p.shape)
                offset += p.numel()
        return found
    return None


@contextlib.contextmanager
def read_weights(params, zero3: bool, read_master: Optional[Callable[[torch.Tensor], torch.Tensor]] = None):
    """The full weights of ``params`` as the monitors read them: the optimizer's float32 master copy
    (``read_master``, from :func:`master_weight_reader`), else the module's parameters (gathered under ZeRO-3).
    Either way a collective where the weights are partitioned, issued by every rank in the same order."""
    if read_master is not None:
        yield [read_master(p).detach() for p in params]
        return
    with _gathered(params, zero3):
        yield [p.detach() for p in params]


class HFAttention:
    """One attention layer of an HF model: where its Q/K weights live, and the fused buffer the monitor reads."""

    def __init__(self, layer: int, name: str, layout: str, geometry: AttentionGeometry,
                 q: Optional[torch.nn.Parameter] = None, k: Optional[torch.nn.Parameter] = None,
                 fused: Optional[torch.nn.Parameter] = None, transposed: bool = False,
                 module: Optional[torch.nn.Module] = None):
        self.layer, self.name, self.layout, self.geometry = layer, name, layout, geometry
        self.module = module  # the HF attention module itself (its forward is where the logits are captured)
        self.q, self.k, self.fused, self.transposed = q, k, fused, transposed
        H, G, dh = geometry.num_heads, geometry.num_kv_heads, geometry.head_dim
        if layout == "separate":
            d_model = _full_shape(q)[1]
            for what, p, count in (("q_proj", q, H), ("k_proj", k, G)):
                if _full_shape(p) != (count * dh, d_model):
                    raise ValueError(f"{name}.{what}.weight has shape {_full_shape(p)}, expected "
                                     f"({count}·{dh}, {d_model}) from the model config (heads {H}, kv heads {G}, "
                                     f"head_dim {dh})")
            ref = q
        else:
            shape = _full_shape(fused)
            if transposed:
                shape = shape[::-1]
            rows = (H + 2 * G) * dh
            if shape[0] != rows:
                raise ValueError(f"{name}: fused QKV weight has {shape[0]} output rows, expected (H + 2G)·d_head = "
                                 f"({H} + 2·{G})·{dh} = {rows} from the model config")
            d_model = shape[1]
            ref = fused
        self.d_model = d_model
        dtype = torch.float64 if ref.dtype == torch.float64 else torch.float32
        self.buffer = torch.zeros((H + 2 * G) * dh, d_model, dtype=dtype, device=ref.device)
        self.zero3 = is_zero3_param(ref)

    @property
    def params(self) -> list:
        return [self.q, self.k] if self.layout == "separate" else [self.fused]

    def spec(self) -> AttentionLayer:
        g = self.geometry
        return AttentionLayer(layer=self.layer, qkv_weight=self.buffer, num_heads=g.num_heads,
                              num_query_groups=g.num_kv_heads, head_dim=g.head_dim, head_offset=0)

    @torch.no_grad()
    def refresh(self, read_master: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> None:
        """Copy the Q and K weights into the buffer: the live ones, or the optimizer's float32 master copy
        (``read_master``); a collective on every rank where they are partitioned (:func:`read_weights`)."""
        g = self.geometry
        with read_weights(self.params, self.zero3, read_master) as weights:
            if self.layout == "separate":
                q_rows, k_rows = weights
            else:
                w = weights[0]
                if self.transposed:
                    w = w.t()
                if self.layout == "grouped":
                    self.buffer.copy_(w)
                    return
                q_rows, k_rows, _ = concatenated_qkv_blocks(w, g.num_heads, g.num_kv_heads, g.head_dim)
            grouped_qkv_from_blocks(q_rows, k_rows, None, g.num_heads, g.num_kv_heads, g.head_dim, out=self.buffer)


def _layer_index(module: torch.nn.Module, name: str, position: int) -> int:
    idx = getattr(module, "layer_idx", None)
    if isinstance(idx, int) and not isinstance(idx, bool):
        return idx
    numbers = re.findall(r"\.(\d+)\.", f".{name}.")
    return int(numbers[-1]) if numbers else position


def find_hf_attention(model: torch.nn.Module, layout: str = "auto", geometry: Optional[AttentionGeometry] = None
                      ) -> list[HFAttention]:
    """Every attention layer of ``model`` (a bare HF model or a DeepSpeed engine's ``module``), in module order.

    ``layout``: ``auto`` (separate ``q_proj``/``k_proj`` first, else a known fused name with its default
    layout), or force ``separate`` / ``grouped`` / ``concatenated`` for the fused weight. Raises ``ValueError``
    when nothing is found or a weight's shape disagrees with the config, naming the module.
    """
    if layout not in ("auto", "separate", "grouped", "concatenated"):
        raise ValueError(f"attention layout must be auto, separate, grouped or concatenated, got {layout!r}")
    geometry = geometry or attention_geometry(model)
    found: list[HFAttention] = []
    for name, module in model.named_modules():
        q, k = getattr(module, "q_proj", None), getattr(module, "k_proj", None)
        if isinstance(q, torch.nn.Module) and isinstance(k, torch.nn.Module) and layout in ("auto", "separate") \
                and isinstance(getattr(q, "weight", None), torch.Tensor):
            found.append(HFAttention(_layer_index(module, name, len(found)), name, "separate", geometry,
                                     q=q.weight, k=k.weight, module=module))
            continue
        if layout == "separate":
            continue
        for attr, (default_layout, transposed) in FUSED_QKV_MODULES.items():
            sub = getattr(module, attr, None)
            if isinstance(sub, torch.nn.Module) and isinstance(getattr(sub, "weight", None), torch.Tensor):
                found.append(HFAttention(_layer_index(module, name, len(found)), f"{name}.{attr}",
                                         default_layout if layout == "auto" else layout, geometry,
                                         fused=sub.weight, transposed=transposed))
                break
    if not found:
        raise ValueError("attention monitors: no attention layer found (looked for q_proj/k_proj and fused "
                         f"{', '.join(FUSED_QKV_MODULES)}); set \"mech\": {{\"monitors\": []}} or name the layout")
    layers = [a.layer for a in found]
    if len(set(layers)) != len(layers):
        raise ValueError(f"attention monitors: duplicate layer indices {layers} among {[a.name for a in found]}")
    logger.info("megatron-mech: %d attention layers (%s layout), H=%d G=%d d_head=%d", len(found),
                found[0].layout, geometry.num_heads, geometry.num_kv_heads, geometry.head_dim)
    return found


def hf_attention_logit_captures(sources: list[HFAttention]) -> list:
    """``capture(record)`` for every attention layer of ``sources`` whose queries and keys can be rebuilt exactly:
    separate ``q_proj``/``k_proj`` (Llama, Mistral, Qwen2/3, Mixtral, …) in a module whose model file defines
    ``apply_rotary_pos_emb`` and whose forward receives ``position_embeddings`` (``(cos, sin)``, as every HF model
    with rotary embeddings does). A layer of another kind (fused QKV, no rotary helper) gets none: its maximum logit
    is not recorded. The capture keeps the projections' outputs of an evaluation step (forward hooks on ``q_proj``
    and ``k_proj``, on the weights the model ran, gathered under ZeRO-3 as the forward gathers them), applies the
    module's own ``q_norm``/``k_norm`` when it has them and its rotary embedding, and hands ``record`` the queries
    ``[b, h, s, d]``, the keys ``[b, g, s, d]``, the module's ``scaling`` and ``is_causal`` after the module's
    forward: the logits its attention kernel computed. While ``record.capturing`` is False the hooks return before
    touching a tensor. Installing again replaces ``record``."""
    captures = []
    for source in sources:
        module = source.module
        rotary = getattr(sys.modules.get(type(module).__module__), "apply_rotary_pos_emb", None) \
            if module is not None else None
        if source.layout != "separate" or rotary is None:
            continue
        captures.append(functools.partial(_install_logit_capture, module, source.layer, source.geometry.head_dim,
                                          rotary))
    skipped = len(sources) - len(captures)
    if skipped:
        logger.info("megatron-mech: max attention logit not captured in %d of %d attention layers (fused QKV or no "
                    "rotary helper in the model's file)", skipped, len(sources))
    return captures


def _capturing(module: torch.nn.Module) -> bool:
    return bool(getattr(module._mech_record_logits, "capturing", True))


def _install_logit_capture(module: torch.nn.Module, layer: int, head_dim: int, rotary, record) -> None:
    """The hooks of :func:`hf_attention_logit_captures` on one attention ``module`` (once; ``record`` replaced)."""
    module._mech_record_logits = record
    if getattr(module, "_mech_logit_hooks", None):
        return
    kept: dict = {}

    def keep(name):
        def hook(_mod, _args, output):
            if _capturing(module):
                kept[name] = output.detach()
        return hook

    def after_forward(mod, args, kwargs, _output):
        query, key = kept.pop("q", None), kept.pop("k", None)
        if not _capturing(mod) or query is None or key is None:
            return None
        embeddings = kwargs.get("position_embeddings", args[1] if len(args) > 1 else None)
        if embeddings is None:
            return None
        with torch.no_grad():
            query = query.view(*query.shape[:-1], -1, head_dim)
            key = key.view(*key.shape[:-1], -1, head_dim)
            if getattr(mod, "q_norm", None) is not None and getattr(mod, "k_norm", None) is not None:
                query, key = mod.q_norm(query), mod.k_norm(key)
            cos, sin = embeddings
            query, key = rotary(query.transpose(1, 2), key.transpose(1, 2), cos, sin)
            mod._mech_record_logits(layer, query, key, float(getattr(mod, "scaling", head_dim ** -0.5)),
                                    bool(getattr(mod, "is_causal", True)))
        return None

    module._mech_logit_hooks = [module.q_proj.register_forward_hook(keep("q")),
                                module.k_proj.register_forward_hook(keep("k")),
                                module.register_forward_hook(after_forward, with_kwargs=True)]
