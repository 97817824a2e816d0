"""The attention monitor's metric names: ONE table, :func:`unit_entries`, gives every metric of a unit (a layer or an
extra linear) its name, its ``details`` attribution and the key of its value, in a fixed order. Evaluation fills
values by key, the data-parallel combine packs them in this order, and both read the names from here.

Names (``L`` = global layer index, ``H`` = global head index, ``r`` = TP rank)
-----------------------------------------------------------------------------
* ``attn/layer{L}/dwq_entropy``, ``dwk_entropy``: normalised spectral entropy (p ∝ σ^power, divided by
  log of min(m, n)) of ΔW of the Q rows ``[H·d_head, d_model]`` and K rows ``[G·d_head, d_model]`` of
  ``linear_qkv``; in the ``global`` scope of the *whole* matrix across TP. Also ``dwq_effective_rank``
  (exp of the unnormalised entropy), ``dwq_stable_rank`` (‖ΔW‖_F²/‖ΔW‖₂²), ``dwq_fro`` (‖ΔW‖_F),
  ``dwq_frozen`` and ``dwq_update_ratio`` (‖ΔW‖_F / ‖W_{t−δ}‖_F), same for ``dwk``. Of these only
  ``dwq_entropy`` and ``dwk_entropy`` match ``detect.default_rules`` (``attn/*/dw?_entropy``) and are alerted on;
  the rest are logged.
* ``attn/layer{L}/head{H}/{term}_entropy`` for ``term`` in ``qk_terms`` (Δ1, Δ2 — the early-warning one —
  and Δ3, see :func:`~megatron_mech.core.spectral.qk_increment_spectra`), and head aggregates
  ``attn/layer{L}/{term}_entropy_mean`` / ``_min`` (NaN if any head is NaN: a NaN is a fault flag). Only the
  per-head ``delta2_entropy`` is alerted on by default (``attn/*/head*/delta2_entropy``); Δ1, Δ3 and the
  aggregates are logged.
* Frozen matrices: when ΔW is exactly zero (a frozen layer, or lr 0), its spectrum is empty and every
  spectral metric would be NaN — which a detector reads as a fault. Instead ``{prefix}_frozen`` is 1.0 (0.0
  otherwise) and the undefined metrics are ``None`` ("not measured"; detectors skip them): the matrix's
  entropy, effective and stable rank, and the per-head terms that vanish with it (Δ3 when either ΔW_q or ΔW_k is
  zero, Δ1/Δ2 when both are) with their aggregates. A NaN therefore always means non-finite weights.
* Extra linears (``extra_linears={name: (weight, shard_dim)}``): ``linear/{name}/dw_entropy``,
  ``dw_effective_rank``, ``dw_stable_rank``, ``dw_fro``, ``dw_frozen``, ``dw_update_ratio`` — not matched by the
  default alert rules (they are not attention-family signals; add a rule to alert on them).
* ``dw_scope="slice"``: ΔW and aggregate names gain a TP qualifier, ``attn/layer{L}/tp{r}/dwq_entropy``,
  ``attn/layer{L}/tp{r}/delta2_entropy_mean``, ``linear/{name}/tp{r}/dw_entropy``; per-head names are unchanged
  (global head indices) and each rank reports its own heads.

``details[name]`` attributes every metric: ``{"layer": L, "matrix": "q"}``, ``{"layer": L, "head": H,
"term": "delta2"}``, ``{"layer": L, "term": "delta2"}``, ``{"linear": name}`` (+ ``"tp_rank": r`` in slice scope).
"""
from __future__ import annotations

from typing import Hashable, Optional, Sequence

__all__ = ["DW_QUANTITIES", "HEAD_AGGREGATES", "unit_entries"]

DW_QUANTITIES = ("entropy", "effective_rank", "stable_rank", "fro", "frozen", "update_ratio")
"""What each ΔW reports, in this order; a ΔW's values are keyed by these."""
HEAD_AGGREGATES = ("mean", "min")
"""The aggregates over a layer's heads of each QK term."""


def unit_entries(kind: str, ident, *, terms: Sequence[str] = (), heads: range = range(0),
                 tp_rank: Optional[int] = None) -> list[tuple[str, dict, Hashable]]:
    """``(name, detail, key)`` of every metric of one unit, in the fixed order.

    Args:
        kind: ``"layer"`` (``ident`` = global layer index) or ``"extra"`` (``ident`` = the linear's name).
        terms: the QK terms with per-head metrics (layers only).
        heads: the global indices of the heads reported (layers only).
        tp_rank: ``None`` in global scope; the rank in slice scope (names and details gain it).

    Keys: an extra linear's values are keyed by quantity (``"entropy"``); a layer's by ``(matrix, quantity)``,
    ``(term, aggregate)`` and ``(term, head)``.
    """
    tag, scope = ("", {}) if tp_rank is None else (f"/tp{tp_rank}", {"tp_rank": tp_rank})
    if kind == "extra":
        return [(f"linear/{ident}{tag}/dw_{what}", {"linear": ident, **scope}, what) for what in DW_QUANTITIES]
    L = ident
    out = [(f"attn/layer{L}{tag}/dw{m}_{what}", {"layer": L, "matrix": m, **scope}, (m, what))
           for m in ("q", "k") for what in DW_QUANTITIES]
    for term in terms:
        out += [(f"attn/layer{L}{tag}/{term}_entropy_{agg}", {"layer": L, "term": term, **scope}, (term, agg))
                for agg in HEAD_AGGREGATES]
        out += [(f"attn/layer{L}/head{h}/{term}_entropy", {"layer": L, "head": h, "term": term, **scope}, (term, h))
                for h in heads]
    return out
