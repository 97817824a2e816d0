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
  ``dwq_entropy`` and ``dwk_entropy`` match the attention monitor's rules (``attn/*/dw?_entropy``,
  :mod:`~megatron_mech.monitors.attention.rules`) and are alerted on; the rest are logged.
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

from megatron_mech.monitors.metric_names import render

__all__ = ["AGGREGATE_NAME", "DW_NAME", "DW_QUANTITIES", "HEAD_AGGREGATES", "HEAD_NAME", "LINEAR_NAME",
           "unit_entries"]

DW_QUANTITIES = ("entropy", "effective_rank", "stable_rank", "fro", "frozen", "update_ratio")
"""What each ΔW reports, in this order; a ΔW's values are keyed by these."""
HEAD_AGGREGATES = ("mean", "min")
"""The aggregates over a layer's heads of each QK term."""

# The names, each written once (:mod:`megatron_mech.monitors.metric_names` syntax; docs/metrics.md is rendered from
# these): ``m`` is ``q`` or ``k``, ``quantity`` one of DW_QUANTITIES, ``aggregate`` one of HEAD_AGGREGATES.
DW_NAME = "attn/layer{L}[/tp{r}]/dw{m}_{quantity}"
HEAD_NAME = "attn/layer{L}/head{H}/{term}_entropy"
AGGREGATE_NAME = "attn/layer{L}[/tp{r}]/{term}_entropy_{aggregate}"
LINEAR_NAME = "linear/{linear}[/tp{r}]/dw_{quantity}"


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
    tag, scope = ({}, {}) if tp_rank is None else ({"r": tp_rank}, {"tp_rank": tp_rank})
    if kind == "extra":
        return [(render(LINEAR_NAME, linear=ident, quantity=what, **tag), {"linear": ident, **scope}, what)
                for what in DW_QUANTITIES]
    L = ident
    out = [(render(DW_NAME, L=L, m=m, quantity=what, **tag), {"layer": L, "matrix": m, **scope}, (m, what))
           for m in ("q", "k") for what in DW_QUANTITIES]
    for term in terms:
        out += [(render(AGGREGATE_NAME, L=L, term=term, aggregate=agg, **tag), {"layer": L, "term": term, **scope},
                 (term, agg)) for agg in HEAD_AGGREGATES]
        out += [(render(HEAD_NAME, L=L, H=h, term=term), {"layer": L, "head": h, "term": term, **scope}, (term, h))
                for h in heads]
    return out
