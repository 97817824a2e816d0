"""How many series one evaluation records for the whole model at the frontier layouts of
``benchmarks/frontier_shards.py`` (``LAYOUTS``: the 70B-shaped dense model and the DeepSeek-style MoE), per family,
per-unit (one head, one expert) against per-layer, and how many the writers get under ``--mech-writer-level
summary`` — what a W&B project or a TensorBoard run receives per evaluation.

Every name comes from the code, not from arithmetic here:

* attention: the monitor's one name table, :func:`megatron_mech.monitors.attention.names.unit_entries`, for every
  layer with all its heads and the default QK terms (``AttentionMonitorConfig().qk_terms``), global ΔW scope (the
  default);
* router (MoE): :meth:`RouterEvaluator.observe <megatron_mech.monitors.router.RouterEvaluator.observe>` of the real
  monitor on every MoE layer (a router weight of the layout's expert count and a few random logits; the names do
  not depend on the values);
* experts (``--mech-experts``, off by default; MoE): :meth:`ExpertEvaluator.observe
  <megatron_mech.monitors.experts.ExpertEvaluator.observe>` of the real monitor on every layer's experts (1×1
  matrices: the names depend only on the counts);
* symptoms: the ``symptom/*`` rows of the metrics reference (:data:`megatron_mech.records.metrics_reference.METRICS`),
  the per-layer maximum attention logit once per layer.

The summary count is :func:`~megatron_mech.records.writer_level.summary_metrics` of that name set at a step without
alerts. Every layer of the MoE layout is an MoE layer, as in ``frontier_shards.py``.

    python benchmarks/series_count.py            # writes results/series_count.{md,json}
"""
from __future__ import annotations

import argparse
import collections

import torch

from megatron_mech.monitors.attention import AttentionMonitorConfig
from megatron_mech.monitors.attention.names import unit_entries
from megatron_mech.monitors.experts import ExpertEvaluator, ExpertLayer
from megatron_mech.monitors.metric_names import render
from megatron_mech.monitors.router import RouterEvaluator, RouterLayer
from megatron_mech.records.metrics_reference import METRICS
from megatron_mech.records.writer_level import AUTO_SUMMARY_SERIES, per_unit_family, summary_metrics

try:
    from _results import write_results
    from frontier_shards import LAYOUTS, Layout
except ImportError:  # run as a module
    from benchmarks._results import write_results
    from benchmarks.frontier_shards import LAYOUTS, Layout

FAMILIES = ("attention", "router", "experts", "symptoms")


def attention_names(layout: Layout) -> list[str]:
    terms = AttentionMonitorConfig().qk_terms
    return [name for L in range(layout.layers)
            for name, _, _ in unit_entries("layer", L, terms=terms, heads=range(layout.heads))]


def router_names(layout: Layout) -> list[str]:
    if not layout.experts:
        return []
    gen = torch.Generator().manual_seed(0)
    monitor = RouterEvaluator([RouterLayer(L, torch.randn(layout.experts, 4, generator=gen), layout.topk)
                             for L in range(layout.layers)])
    monitor.capturing = True  # the logits below are counted (series of the load appear only with tokens)
    for L in range(layout.layers):
        monitor.record(L, torch.randn(16, layout.experts, generator=gen))
    return list(monitor.observe(1)[0])


def expert_names(layout: Layout) -> list[str]:
    if not layout.experts:
        return []
    layers = [ExpertLayer(L, [[torch.ones(1, 1)] for _ in range(layout.experts)], 0, layout.experts)
              for L in range(layout.layers)]
    monitor = ExpertEvaluator(layers, interval=1)
    monitor.observe(0)  # the snapshot
    for layer in layers:
        for (weight,) in layer.experts:
            weight.add_(1.0)
    return list(monitor.observe(1)[0])


def symptom_names(layout: Layout) -> list[str]:
    """The ``symptom/*`` rows of the metrics reference, a per-layer row (``{L}``) once per layer."""
    return [render(entry.name, L=L) if "{L}" in entry.name else entry.name
            for entry in METRICS if entry.name.startswith("symptom/")
            for L in (range(layout.layers) if "{L}" in entry.name else (None,))]


def count(layout: Layout, experts: bool) -> dict:
    """Per family: series, of which per-unit and per-layer (or none), and the summary writers' share."""
    names = {"attention": attention_names(layout), "router": router_names(layout),
             "experts": expert_names(layout) if experts else [], "symptoms": symptom_names(layout)}
    rows = {}
    for family, family_names in names.items():
        per_unit = sum(per_unit_family(n) is not None for n in family_names)
        units = collections.Counter(per_unit_family(n)[1] for n in family_names if per_unit_family(n) is not None)
        rows[family] = {"series": len(family_names), "per_unit": per_unit, "other": len(family_names) - per_unit,
                        "units": dict(units),
                        "summary": len(summary_metrics(dict.fromkeys(family_names, 0.0)))}
    total = {key: sum(r[key] for r in rows.values()) for key in ("series", "per_unit", "other", "summary")}
    return {"families": rows, "total": total}


def report(results: dict) -> str:
    lines = ["Series recorded by one evaluation of the whole model (every layer, every head / expert), by family; "
             "`per-unit` = one head's or one expert's series (`attn/layer{L}/head{H}/...`, "
             "`expert/layer{L}/e{E}/...`), `per-layer or model` = the rest; `summary` = what TensorBoard/W&B/"
             f"DeepSpeed's monitor get per evaluation under `--mech-writer-level summary` (and `auto`, the default, "
             f"above {AUTO_SUMMARY_SERIES} series) at a step without alerts. Names from the monitors' own code "
             "(module docstring of `benchmarks/series_count.py`). W&B recommends under 10,000 distinct metrics "
             "per project.", ""]
    for key, result in results.items():
        layout = LAYOUTS[key.split("+")[0]]
        experts = "+experts" in key
        lines += [f"## {layout.name}{' with --mech-experts' if experts else ''}", "",
                  f"{layout.layers} layers × {layout.heads} heads"
                  + (f", {layout.experts} experts per layer" if layout.experts else ""), "",
                  "| family | series | per-unit | per-layer or model | per-unit share | summary |",
                  "|---|---:|---:|---:|---:|---:|"]
        for family, row in [*result["families"].items(), ("**total**", result["total"])]:
            if not row["series"]:
                continue
            share = f"{row['per_unit'] / row['series']:.0%}"
            lines.append(f"| {family} | {row['series']:,} | {row['per_unit']:,} | {row['other']:,} | {share} | "
                         f"{row['summary']:,} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    results = {}
    for key, layout in LAYOUTS.items():
        results[key] = count(layout, experts=False)
        if layout.experts:
            results[f"{key}+experts"] = count(layout, experts=True)
    path = write_results("series_count", report(results), {"results": results})
    print(path)


if __name__ == "__main__":
    main()
