"""The module taxonomy: parameter name → module class, shared by MoLS and the monitors.

Classes (:data:`MODULE_CLASSES`)::

    embedding  token / position embeddings          (word_embeddings, position_embeddings, embed_tokens, wte, wpe)
    qk         attention query/key projections      (q_proj, k_proj, fused QKV: linear_qkv, qkv_proj, c_attn, ...)
    vo         attention value/output projections   (v_proj, o_proj, Megatron's linear_proj, GPT-2 attn.c_proj)
    mlp        dense feed-forward, incl. MoE shared experts (GPT-2 mlp.c_fc / mlp.c_proj)
    head       output projection                     (output_layer, lm_head)
    router     MoE gate                              (mlp.router, block_sparse_moe.gate, deepspeed_moe.gate.wg)
    experts    routed MoE experts                    (mlp.experts.*, experts.N.w1, deepspeed_experts.*)
    norm       every normalisation layer's weight and bias
    other      anything not recognised (reported once per :func:`classify_parameters` call in a warning)

Matching is by *module-name segments* (a dotted component such as ``linear_qkv``), searched anywhere in the
name, so wrapper prefixes need no handling: Megatron DDP ``module.``, ``Float16Module`` ``module.module.``,
DeepSpeed's engine ``module.``, FSDP/compile wrappers, PEFT's ``base_model.model.``. Rules are tried in a fixed
order (:data:`RULES`); the first match wins. ``extra_rules`` (user regexes, ``re.search`` on the full name) are
tried before all of them, for custom forks.

Rules chosen
------------
* **Fused QKV** (:data:`FUSED_QKV_MODULES`, the one list that MoLS and the attention monitors' discovery both
  read). Megatron's ``self_attention.linear_qkv`` (and legacy Megatron-LM / Megatron-DeepSpeed and GPT-NeoX /
  Falcon ``query_key_value``, same per-query-group layout), Phi-3 ``qkv_proj``, MPT ``Wqkv`` and GPT-2
  ``c_attn`` (``[Q | K | V]``; GPT-2's ``Conv1D`` stores it ``[in, out]``) are each *one* parameter holding Q, K
  and V. :func:`classify` returns ``"qk"`` for them; :func:`is_fused_qkv` marks them, and
  :func:`fused_qkv_blocks` splits them (through :mod:`megatron_mech.core.layouts`, the one home of the layouts)
  into Q, K and V row blocks so MoLS measures S per block: q and k blocks count towards ``qk``, the v block
  towards ``vo`` (:data:`FUSED_QKV_BLOCK_CLASS`). The parameter still gets a single lr multiplier, computed by
  :func:`fused_qkv_multiplier`; its default rule is the **row-weighted geometric mean**
  ``α = α_qk^((H+G)/(H+2G)) · α_vo^(G/(H+2G))`` (H query heads, G query groups: the fused weight has H·d_head
  Q rows and G·d_head rows each of K and V). It is the least-squares compromise in log-lr space over the
  rows, ``argmin_a Σ_rows (log a − log α_row)²``; ``rule="qk"`` / ``rule="vo"`` give the two extremes for
  comparison. With MHA (G = H) it is ``α_qk^(2/3) α_vo^(1/3)``; with few groups it tends to ``α_qk``.
  In a Megatron model the ``qk`` class therefore holds only fused parameters, and its group multiplier is
  ``fused_qkv_multiplier(...)`` rather than ``α_qk``.
* **Tied embeddings** (:func:`classify_parameters`). Each parameter *object* is classified once. When one
  tensor appears under two names (HF ``lm_head.weight`` is ``model.embed_tokens.weight``; pass
  ``named_parameters(remove_duplicate=False)`` or the module itself to see both names), it is classified
  ``"embedding"`` if any of its names is an embedding or head, under its first name; the other names are
  recorded in :attr:`ModuleTaxonomy.aliases`. Megatron with ``share_embeddings_and_output_weights`` and one
  pipeline stage has no ``output_layer.weight`` at all; with pipeline parallelism the last stage holds a
  *copy* of the embedding as ``output_layer.weight`` marked ``shared_embedding=True`` whose gradient is
  all-reduced with the first stage's — it is classified ``"embedding"`` too (otherwise the two copies would
  get different lrs and drift apart). ``tied_embedding=True`` forces every head parameter to ``"embedding"``
  (frameworks that keep a tied copy without that attribute); ``tied_embedding=False`` asserts the model is
  untied and raises ``ValueError`` on any evidence of a tie.
* **Shared experts** (Megatron ``mlp.shared_experts.*`` incl. ``gate_weight``, Qwen-MoE ``shared_expert``,
  ``shared_expert_gate``) are ``"mlp"``: they are dense FFNs that see every token, so their gradient statistics
  are those of a dense MLP, not of the sparsely-fed routed experts, and Megatron keeps them in the dense
  (non-expert-parallel) parameter groups.
* **Biases** take their module's class, without exception (``linear_qkv.bias`` is fused ``qk`` like the weight;
  a norm's bias is ``norm``; a router bias is ``router``). A caller that wants to leave biases at 1.0 can test
  the name itself.
* **Norms**: any segment containing ``norm`` (``input_layernorm``, ``pre_mlp_layernorm``, ``q_layernorm``,
  ``final_layernorm``, HF ``model.norm``, ``post_attention_layernorm``, Qwen3 ``q_norm``, MTP ``enorm``) and
  TE's fused ``linear_qkv.layer_norm_weight`` / ``linear_fc1.layer_norm_bias``, plus GPT-2 style ``ln_*``.
  Norms are checked first, so a norm fused into a linear is ``norm``, not its linear's class.
* **LoRA / adapters** take their base module's class: PEFT ``q_proj.lora_A.default.weight``,
  ``q_proj.base_layer.weight``, ``embed_tokens.lora_embedding_A.default``, ``lm_head.modules_to_save...``, and
  Megatron-bridge ``linear_qkv.adapter.linear_in.weight``, because the base module's segment is in the name.
  Adapters under a fused QKV are :func:`is_fused_qkv` (they serve Q, K and V); only tensors whose rows follow
  the fused layout (the weight, its bias, a LoRA B) can be split by :func:`fused_qkv_blocks`.
* **MLA** (DeepSeek multi-latent attention, Megatron ``linear_q_proj``, ``linear_q_down_proj``,
  ``linear_q_up_proj``, ``linear_kv_down_proj``, ``linear_kv_up_proj``): all ``"qk"``. The KV projections also
  produce V (a fused K/V without a row-split helper yet); ``kv_layernorm`` is ``norm``.
"""
from __future__ import annotations

import math
import re
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from megatron_mech.core.layouts import concatenated_qkv_blocks, qkv_row_blocks

__all__ = [
    "FUSED_QKV_BLOCK_CLASS",
    "FUSED_QKV_MODULES",
    "MODULE_CLASSES",
    "RULES",
    "ModuleTaxonomy",
    "UnknownParameterWarning",
    "classify",
    "classify_parameters",
    "fused_qkv_blocks",
    "fused_qkv_layout",
    "fused_qkv_multiplier",
    "is_fused_qkv",
]

MODULE_CLASSES = ("embedding", "qk", "vo", "mlp", "head", "router", "experts", "norm", "other")

# The class each row block of a fused QKV parameter is measured under.
FUSED_QKV_BLOCK_CLASS = {"q": "qk", "k": "qk", "v": "vo"}


class UnknownParameterWarning(UserWarning):
    """Parameters whose names no taxonomy rule recognises (classified ``"other"``)."""


def _seg(*names: str) -> str:
    """Regex: one of ``names`` as a whole dotted segment (``a.b.NAME.c`` or at either end)."""
    return r"(?:^|\.)(?:" + "|".join(names) + r")(?:\.|$)"


def _seq(*names: str) -> str:
    """Regex: consecutive dotted segments ``names[0].names[1]...`` anywhere in the name."""
    return r"(?:^|\.)" + r"\.".join(names) + r"(?:\.|$)"


# Fused Q/K/V modules: module name -> (row layout, stored transposed). "grouped": Megatron's per-query-group rows
# (layouts.qkv_row_blocks); "concatenated": [Q | K | V] rows (layouts.concatenated_qkv_blocks); transposed: the
# weight is [in, out] (GPT-2 Conv1D), its columns follow the layout. The attention monitors' HF discovery reads
# this table too, so MoLS and the monitors always agree on what is a fused QKV.
FUSED_QKV_MODULES: dict[str, tuple[str, bool]] = {
    "linear_qkv": ("grouped", False),        # megatron-core
    "query_key_value": ("grouped", False),   # legacy Megatron-LM / Megatron-DeepSpeed, GPT-NeoX, Falcon
    "qkv_proj": ("concatenated", False),     # Phi-3
    "Wqkv": ("concatenated", False),         # MPT
    "c_attn": ("concatenated", True),        # GPT-2 (Conv1D)
}
_FUSED_QKV = _seg(*FUSED_QKV_MODULES)
_FUSED_QKV_RE = re.compile(_FUSED_QKV)

# (regex, class), first match wins. Order matters: norms (also fused into linears) before everything; router
# and routed experts before the dense-MLP names their experts reuse; shared experts before experts would not
# matter (``experts`` is matched as a whole segment, never inside ``shared_experts``) but is kept explicit.
RULES: tuple[tuple[re.Pattern, str], ...] = tuple((re.compile(p), c) for p, c in (
    # --- norms: any segment containing "norm", TE's fused layer_norm_weight/bias, GPT-2 style ln_1 / ln_f
    (r"(?:^|\.)[^.]*norm[^.]*(?:\.|$)", "norm"),
    (_seg(r"ln_\w+", "ln"), "norm"),
    # --- MoE shared experts: dense FFNs (see module docstring)
    (_seg("shared_experts", "shared_expert", "shared_expert_gate", "shared_mlp"), "mlp"),
    # --- MoE router / gate (Megatron TopKRouter, Mixtral/Qwen-MoE/DeepSeek `gate`, DeepSpeed `gate.wg`)
    (_seg("router", "gate"), "router"),
    # --- routed experts (Megatron SequentialMLP local_experts, GroupedMLP weight1/2, TEGroupedMLP
    #     linear_fc1.weight0, Mixtral/Qwen experts.N, DeepSpeed deepspeed_experts)
    (_seg("experts", "local_experts", "deepspeed_experts"), "experts"),
    # --- embeddings
    (_seg("word_embeddings", "position_embeddings", "tokentype_embeddings", "embed_tokens", "embed_positions",
          "wte", "wpe"), "embedding"),
    # --- output head
    (_seg("output_layer", "lm_head", "embed_out"), "head"),
    # --- attention Q/K (fused QKV included, see fused_qkv_multiplier), MLA projections
    (_FUSED_QKV, "qk"),
    (_seg("q_proj", "k_proj", "linear_q_proj", "linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj",
          "linear_kv_up_proj"), "qk"),
    # --- attention V/O (Megatron linear_proj; legacy Megatron-LM self_attention.dense; GPT-2 attn.c_proj, MPT
    #     attn.out_proj: names that are only attention outputs under an attention module)
    (_seg("v_proj", "o_proj", "linear_proj"), "vo"),
    (_seq("(?:self_attention|attention)", "dense"), "vo"),
    (_seq("(?:attn|self_attn|attention|self_attention)", "(?:c_proj|out_proj)"), "vo"),
    # --- dense MLP (Megatron linear_fc1/2, LLaMA gate/up/down_proj, legacy dense_h_to_4h/4h_to_h)
    (_seg("linear_fc1", "linear_fc2", "gate_proj", "up_proj", "down_proj", "gate_up_proj", "dense_h_to_4h",
          "dense_4h_to_h"), "mlp"),
    (_seq("mlp", "(?:c_fc|c_proj)"), "mlp"),   # GPT-2
))

_ExtraRules = Iterable[tuple["str | re.Pattern", str]]


def _compile_extra(extra_rules: _ExtraRules | None) -> list[tuple[re.Pattern, str]]:
    out = []
    for rule in extra_rules or ():
        try:
            pattern, cls = rule
        except (TypeError, ValueError):
            raise ValueError(f"extra rule must be a (regex, class) pair, got {rule!r}") from None
        _check_class(cls)
        out.append((pattern if isinstance(pattern, re.Pattern) else re.compile(pattern), cls))
    return out


def _check_class(cls: str) -> str:
    if cls not in MODULE_CLASSES:
        raise ValueError(f"unknown module class {cls!r}; expected one of {', '.join(MODULE_CLASSES)}")
    return cls


def classify(name: str, extra_rules: _ExtraRules | None = None) -> str:
    """Module class of parameter ``name`` (one of :data:`MODULE_CLASSES`; ``"other"`` when unknown).

    ``extra_rules``: ``[(regex, class), ...]``, tried in order with ``re.search`` on the full name *before* the
    built-in :data:`RULES`. A fused QKV parameter is ``"qk"`` — test :func:`is_fused_qkv` to tell it apart.
    """
    rules = _compile_extra(extra_rules) if extra_rules else ()
    return _classify(name, rules)


def _classify(name: str, extra: Sequence[tuple[re.Pattern, str]]) -> str:
    for pattern, cls in extra:
        if pattern.search(name):
            return cls
    for pattern, cls in RULES:
        if pattern.search(name):
            return cls
    return "other"


def is_fused_qkv(name: str) -> bool:
    """True for a parameter of a fused Q/K/V module (:data:`FUSED_QKV_MODULES`: Megatron ``linear_qkv``,
    ``query_key_value``, Phi-3 ``qkv_proj``, MPT ``Wqkv``, GPT-2 ``c_attn``).

    Covers the weight, its bias and adapters on it (they serve Q, K and V alike), not a layer norm fused into
    it (``linear_qkv.layer_norm_weight`` is a norm).
    """
    return _FUSED_QKV_RE.search(name) is not None and _classify(name, ()) == "qk"


def fused_qkv_layout(name: str) -> tuple[str, str, bool]:
    """``(module name, row layout, transposed)`` of fused QKV parameter ``name`` from :data:`FUSED_QKV_MODULES`
    (the last fused module segment in the name); ``ValueError`` when ``name`` is not :func:`is_fused_qkv`."""
    if not is_fused_qkv(name):
        raise ValueError(f"{name!r} is not a fused QKV parameter (expected a parameter of a "
                         f"{' / '.join(FUSED_QKV_MODULES)} module)")
    module = [seg for seg in name.split(".") if seg in FUSED_QKV_MODULES][-1]
    layout, transposed = FUSED_QKV_MODULES[module]
    return module, layout, transposed


def fused_qkv_blocks(name: str, tensor: torch.Tensor, num_heads: int, num_query_groups: int,
                     head_dim: int) -> dict[str, torch.Tensor]:
    """Split a fused QKV tensor (weight ``[(H+2G)·d_head, d_model]``, or bias ``[(H+2G)·d_head]``, or its
    gradient) into ``{"q": rows, "k": rows, "v": rows}``, in the row layout :func:`fused_qkv_layout` gives for
    ``name`` (:func:`megatron_mech.core.layouts.qkv_row_blocks` or
    :func:`~megatron_mech.core.layouts.concatenated_qkv_blocks`). A transposed weight (GPT-2 ``c_attn``,
    ``[d_model, (H+2G)·d_head]``) is split by columns and its blocks come back as ``[out, in]`` rows.

    ``num_heads`` / ``num_query_groups`` are the counts held by this tensor (per-partition counts for a TP
    shard). Blocks may be views of ``tensor`` (a bias gives 1-D blocks): copy them before keeping them. MoLS
    measures q and k under ``"qk"`` and v under ``"vo"`` (:data:`FUSED_QKV_BLOCK_CLASS`). Raises ``ValueError``
    when ``name`` is not a fused QKV parameter or the tensor's rows do not follow the layout.
    """
    _, layout, transposed = fused_qkv_layout(name)
    if not isinstance(tensor, torch.Tensor) or tensor.dim() not in (1, 2):
        raise ValueError(f"fused QKV tensor {name!r} must be 1-D (bias) or 2-D (weight), got "
                         f"{getattr(tensor, 'shape', type(tensor))}")
    rows = tensor.unsqueeze(-1) if tensor.dim() == 1 else (tensor.t() if transposed else tensor)
    split = qkv_row_blocks if layout == "grouped" else concatenated_qkv_blocks
    try:
        q, k, v = split(rows, num_heads, num_query_groups, head_dim)
    except ValueError as e:
        raise ValueError(f"fused QKV tensor {name!r} ({layout} layout{', stored [in, out]' if transposed else ''}, "
                         f"shape {tuple(tensor.shape)}): {e}") from None
    if tensor.dim() == 1:
        return {"q": q.squeeze(-1), "k": k.squeeze(-1), "v": v.squeeze(-1)}
    return {"q": q, "k": k, "v": v}


FUSED_QKV_RULES = ("rows", "qk", "vo")


def fused_qkv_multiplier(alpha_qk: float, alpha_vo: float, num_heads: int, num_query_groups: int,
                         rule: str = "rows") -> float:
    """The single lr multiplier of a fused QKV parameter from the ``qk`` and ``vo`` multipliers.

    ``rule="rows"`` (default): row-weighted geometric mean ``α_qk^((H+G)/(H+2G)) · α_vo^(G/(H+2G))`` — Q and K
    rows (H + G heads' worth) vote for ``α_qk``, V rows (G) for ``α_vo``; the least-squares choice in log-lr
    space over rows. ``rule="qk"``: ``α_qk``. ``rule="vo"``: ``α_vo``. ``num_heads`` / ``num_query_groups``
    may be global or per-partition counts (only their ratio matters).
    """
    if rule not in FUSED_QKV_RULES:
        raise ValueError(f"unknown fused QKV rule {rule!r}; expected one of {', '.join(FUSED_QKV_RULES)}")
    for label, a in (("alpha_qk", alpha_qk), ("alpha_vo", alpha_vo)):
        try:
            ok = math.isfinite(float(a)) and float(a) > 0
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise ValueError(f"{label} must be a positive finite number, got {a!r}")
    alpha_qk, alpha_vo = float(alpha_qk), float(alpha_vo)
    h, g = int(num_heads), int(num_query_groups)
    if h < 1 or g < 1 or h % g:
        raise ValueError(f"need num_heads >= 1 divisible by num_query_groups >= 1, got {num_heads}, "
                         f"{num_query_groups}")
    if rule == "qk":
        return float(alpha_qk)
    if rule == "vo":
        return float(alpha_vo)
    w_qk = (h + g) / (h + 2 * g)
    return float(math.exp(w_qk * math.log(alpha_qk) + (1.0 - w_qk) * math.log(alpha_vo)))


# ------------------------------------------------------------------------------------------------ per model
@dataclass(eq=False)
class ModuleTaxonomy(Mapping):
    """Classification of a model's parameters: a read-only ``Mapping`` name → class over *unique* parameters.

    ``aliases`` maps each duplicate name of a shared tensor to the name it is classified under; ``unknown``
    lists the names classified ``"other"`` because no rule matched; ``fused_qkv`` the fused QKV names;
    ``tied_embedding`` whether a tied embedding/head was found (or forced).
    """

    classes: dict[str, str]
    aliases: dict[str, str] = field(default_factory=dict)
    unknown: tuple[str, ...] = ()
    fused_qkv: tuple[str, ...] = ()
    tied_embedding: bool = False
    parameters: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

    def __post_init__(self):
        for cls in self.classes.values():
            _check_class(cls)
        for alias, target in self.aliases.items():
            if target not in self.classes:
                raise ValueError(f"alias {alias!r} points at {target!r}, which is not classified")

    # Mapping protocol
    def __getitem__(self, name: str) -> str:
        return self.classes[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.classes)

    def __len__(self) -> int:
        return len(self.classes)

    def class_of(self, name: str) -> str:
        """Class of ``name`` (a duplicate name of a shared tensor resolves to its canonical name's class)."""
        if name in self.classes:
            return self.classes[name]
        if name in self.aliases:
            return self.classes[self.aliases[name]]
        raise KeyError(f"parameter {name!r} is not in this taxonomy")

    def params_of(self, cls: str) -> list[str]:
        """Names (unique parameters, model order) of class ``cls``; empty when none."""
        _check_class(cls)
        return [n for n, c in self.classes.items() if c == cls]

    def tensors_of(self, cls: str) -> list[torch.Tensor]:
        """The parameter tensors of class ``cls`` (needs the taxonomy built by :func:`classify_parameters`)."""
        return [self.parameters[n] for n in self.params_of(cls)]

    def classes_present(self) -> tuple[str, ...]:
        """Classes with at least one parameter, in :data:`MODULE_CLASSES` order."""
        present = set(self.classes.values())
        return tuple(c for c in MODULE_CLASSES if c in present)

    def require_class(self, cls: str) -> list[str]:
        """Validate that ``cls`` is a known class with parameters here; return its names.

        Raises ``ValueError`` ("unknown module class 'foo'; expected one of ...") for a name outside
        :data:`MODULE_CLASSES`, and ("module class 'router' has no parameters in this model; present: ...")
        for a class with no parameters (e.g. an MoLS base module the model does not have).
        """
        names = self.params_of(cls)
        if not names:
            raise ValueError(f"module class {cls!r} has no parameters in this model; present: "
                             f"{', '.join(self.classes_present()) or '(none)'}")
        return names

    def counts(self) -> dict[str, int]:
        """Number of unique parameters per present class."""
        return {c: len(self.params_of(c)) for c in self.classes_present()}


def classify_parameters(named_parameters: Iterable[tuple[str, torch.Tensor]] | torch.nn.Module,
                        tied_embedding: bool | None = None,
                        extra_rules: _ExtraRules | None = None) -> ModuleTaxonomy:
    """Classify every unique parameter of a model once; see the module docstring for the tied-embedding rule.

    ``named_parameters``: ``(name, tensor)`` pairs — pass ``model.named_parameters(remove_duplicate=False)``
    (or the module itself, which does that) so tied names are seen and recorded as aliases.
    ``tied_embedding``: ``None`` detects ties (same tensor object under two names, or Megatron's
    ``shared_embedding`` attribute); ``True`` also turns every head parameter into ``"embedding"``; ``False``
    asserts the model is untied (``ValueError`` if a tie is found).

    Issues ONE :class:`UnknownParameterWarning` listing every unrecognised name (classified ``"other"``).
    Returns a :class:`ModuleTaxonomy` (a ``Mapping`` name → class; ``dict(result)`` for a plain dict).
    """
    if isinstance(named_parameters, torch.nn.Module):
        named_parameters = named_parameters.named_parameters(remove_duplicate=False)
    if tied_embedding not in (None, True, False):
        raise ValueError(f"tied_embedding must be None, True or False, got {tied_embedding!r}")
    extra = _compile_extra(extra_rules)

    classes: dict[str, str] = {}
    params: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    unknown: list[str] = []
    first_name: dict[int, str] = {}
    tie_evidence: list[str] = []

    for name, tensor in named_parameters:
        if name in classes or name in aliases:
            raise ValueError(f"parameter name {name!r} appears twice")
        cls = _classify(name, extra)
        key = id(tensor)
        if key in first_name:  # the same tensor under another name
            canonical = first_name[key]
            aliases[name] = canonical
            pair = {classes[canonical], cls}
            if "embedding" in pair and "head" in pair:
                tie_evidence.append(f"{name!r} is {canonical!r}")
                classes[canonical] = "embedding"
            elif classes[canonical] == "other":  # the alias is the recognisable name of this tensor
                classes[canonical] = cls
            continue
        first_name[key] = name
        if cls == "head" and getattr(tensor, "shared_embedding", False):
            tie_evidence.append(f"{name!r} has shared_embedding=True")
            cls = "embedding"
        elif cls == "head" and tied_embedding:
            cls = "embedding"
        classes[name] = cls
        params[name] = tensor
        if cls == "other":
            unknown.append(name)

    if tied_embedding is False and tie_evidence:
        raise ValueError("tied_embedding=False but the embedding and output head are tied: "
                         + "; ".join(tie_evidence))
    # an alias may have been the only unknown-looking name of a known tensor: report only canonical names
    unknown = [n for n in unknown if classes.get(n) == "other"]
    if unknown:
        warnings.warn(f"{len(unknown)} parameter(s) match no module-taxonomy rule and are classified 'other' "
                      f"(add extra_rules=[(regex, class)] to map them): {', '.join(unknown)}",
                      UnknownParameterWarning, stacklevel=2)
    fused = tuple(n for n, c in classes.items() if c == "qk" and is_fused_qkv(n))
    return ModuleTaxonomy(classes=classes, aliases=aliases, unknown=tuple(unknown), fused_qkv=fused,
                          tied_embedding=bool(tie_evidence) or bool(tied_embedding), parameters=params)
