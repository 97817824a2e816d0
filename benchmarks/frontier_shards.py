"""One rank's monitor cost at frontier layouts, measured on CPU with the real code path and real shard shapes.

Layouts (``LAYOUTS`` below):

* ``70b``: 80 layers, hidden 8192, 64 heads, 8 query groups, d_head 128, FFN 28672 (a Llama-2-70B shape) at
  TP=8, PP=8, DP=16 (1024 ranks).
* ``moe``: a DeepSeek-style MoE: 64 layers (DeepSeek-V3's 61, rounded so PP=8 divides), hidden 7168, 128 heads
  of d_head 128 (its MLA attention approximated by plain multi-head QKV of the same width), 256 routed
  experts, top-8, at TP=1, PP=8, EP=8, DP=32 (256 ranks).

What is measured and what is derived (every figure in the results is labelled):

* **Compute (measured here on CPU).** The rank holds its TP shard of its stage's layers (``L/PP`` layers) and
  evaluates its DP share of them (the default DP split: ``ceil((L/PP) / DP)`` layers on the busiest replica).
  We build exactly those tensors — the fused-QKV shard ``[(h + 2g)·d_head, hidden]`` of each evaluated layer,
  bf16 like training weights — and time :class:`~megatron_mech.monitors.attention.AttentionMonitor` on them
  with the default settings (ΔW route chosen per shape, per-head Δ1/Δ2/Δ3): a snapshot, δ steps of updates,
  an evaluation. In one process the TP collectives are absent; the per-rank arithmetic is the same (local
  Grams / Krylov products of the shard, per-head cores of the rank's own heads). MoE: the router statistics
  of one evaluation step's micro-batches are timed on ``[tokens, experts]`` logits.
* **Communication (derived, exact).** Bytes of each collective per evaluation from the monitor's buffer
  layouts: the TP reduction (packed Grams or Krylov scalars, per-head entropies), the Krylov products (steps ×
  Σ k·block floats), the DP combine (every metric of the stage) and the pipeline exchange (every metric of the
  model).
* **Memory (measured).** Bytes of the snapshots the rank holds (``state_dict`` tensors).
* **Overhead (derived).** per-evaluation compute / (δ × step time) for δ = 10 and 100. Step time, derived from
  a published figure: Llama 2 70B took 1,720,320 A100 GPU-hours for 2.0T tokens (Touvron et al. 2023, "Llama 2",
  Table 2) = 323 tokens/s per GPU; with its 4M-token global batch on 1024 GPUs a step takes 4e6 / (323 × 1024)
  = 12.1 s. The MoE layout uses DeepSeek-V3's reported 180K H800 GPU-hours per trillion tokens (DeepSeek-AI
  2024, "DeepSeek-V3 Technical Report", §1) = 1543 tokens/s per GPU, with a 15.36M-token batch (its final batch
  size 3840 × 4096) on 256 GPUs: 38.9 s per step. CPU monitor time against GPU step time is conservative:
  on the GPU the same evaluation runs faster.

    python benchmarks/frontier_shards.py --record             # both layouts, writes results/frontier_shards.*
    python benchmarks/frontier_shards.py --quick --force      # scaled-down shapes: a smoke check, nothing written

Refuses to time on a loaded machine (``os.getloadavg``) unless ``--force``.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import time

import torch

from megatron_mech.core.router import RoutingStats
from megatron_mech.monitors.attention import AttentionLayer, AttentionMonitor, AttentionMonitorConfig

try:
    from _results import check_idle, write_results
except ImportError:  # run as a module
    from benchmarks._results import check_idle, write_results

log = logging.getLogger("frontier_shards")
QK_TERMS = 3
METRICS_PER_LAYER_DW = 10         # dwq/dwk × (entropy, effective_rank, stable_rank, fro, update_ratio)


@dataclasses.dataclass
class Layout:
    """A model and its parallel layout."""

    name: str
    layers: int
    hidden: int
    heads: int
    groups: int
    head_dim: int
    tp: int
    pp: int
    dp: int
    step_seconds: float          # derived from a published figure (see the module docstring)
    step_source: str
    experts: int = 0
    topk: int = 0
    ep: int = 1
    tokens_per_step: int = 0

    @property
    def stage_layers(self) -> int:
        return self.layers // self.pp

    @property
    def evaluated_layers(self) -> int:
        """Layers the busiest DP replica evaluates (LPT over equal layers: the ceiling)."""
        return -(-self.stage_layers // self.dp)


LAYOUTS = {
    "70b": Layout("70B dense (Llama-2-70B shape)", 80, 8192, 64, 8, 128, tp=8, pp=8, dp=16,
                  step_seconds=4e6 / (2.0e12 / (1_720_320 * 3600) * 1024),
                  step_source="Llama 2 (Touvron et al. 2023) Table 2: 1,720,320 A100-hours / 2.0T tokens; 4M-token "
                              "batch on 1024 GPUs"),
    "moe": Layout("DeepSeek-style MoE", 64, 7168, 128, 128, 128, tp=1, pp=8, dp=32,
                  step_seconds=3840 * 4096 / (1e12 / (180_000 * 3600) * 256),
                  step_source="DeepSeek-V3 report (2024) §1: 180K H800-hours per trillion tokens; 3840 × 4096-token "
                              "batch on 256 GPUs",
                  experts=256, topk=8, ep=8, tokens_per_step=3840 * 4096),
}


def rank_layers(layout: Layout, generator: torch.Generator) -> list[AttentionLayer]:
    """The fused-QKV TP shards (bf16) of the layers this rank evaluates."""
    h, g = layout.heads // layout.tp, layout.groups // layout.tp
    rows = (h + 2 * g) * layout.head_dim
    scale = layout.hidden ** -0.5
    return [AttentionLayer(i, (torch.randn(rows, layout.hidden, generator=generator) * scale).to(torch.bfloat16),
                           h, g, layout.head_dim) for i in range(layout.evaluated_layers)]


def time_attention(layout: Layout, interval: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    layers = rank_layers(layout, gen)
    monitor = AttentionMonitor(layers, AttentionMonitorConfig(interval=interval))
    t0 = time.perf_counter()
    monitor.observe(0)
    snapshot_s = time.perf_counter() - t0
    with torch.no_grad():
        for lay in layers:   # δ optimizer steps of updates, ~1e-2 of the weights (bf16 spacing is 2^-8 ≈ 4e-3
            w = lay.qkv_weight  # relative: smaller random steps would round to zero), plus a coherent rank-4 part
            std = float(w.float().std())
            coherent = torch.randn(w.shape[0], 4, generator=gen) @ torch.randn(4, w.shape[1], generator=gen)
            w.copy_((w.float() + 1e-2 * std * (torch.randn(w.shape, generator=gen) + 0.5 * coherent)).to(w.dtype))
    t0 = time.perf_counter()
    out = monitor.observe(interval)
    evaluate_s = time.perf_counter() - t0        # evaluation + the next snapshot, as in training
    assert out is not None
    snap_bytes = sum(t.numel() * t.element_size() for pair in monitor.state_dict()["snapshots"]["layers"]
                     if pair is not None for t in pair.values())
    routes = sorted({monitor.config.route(layout.hidden)})
    return {"snapshot_s": snapshot_s, "evaluation_s": evaluate_s, "snapshot_bytes": snap_bytes,
            "metrics": len(out[0]), "routes": routes, "layers_evaluated": len(layers)}


def time_router(layout: Layout) -> dict:
    """RoutingStats over one evaluation step's tokens on this rank (DP × EP share), in 8192-token micro-batches."""
    if not layout.experts:
        return {}
    tokens = layout.tokens_per_step // layout.dp
    stats = RoutingStats(layout.experts)
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(8192, layout.experts, generator=gen) * 2.0
    batches = -(-tokens // 8192)
    t0 = time.perf_counter()
    for _ in range(batches):
        stats.update(logits, layout.topk)
    per_layer = time.perf_counter() - t0
    return {"tokens_per_rank": tokens, "router_s_per_layer": per_layer,
            "router_s": per_layer * layout.stage_layers}


def communication(layout: Layout, cfg: AttentionMonitorConfig) -> dict:
    """Bytes per evaluation of each collective (derived from the buffer layouts, float64)."""
    k = layout.hidden
    heads_per_layer = layout.heads
    per_layer_tp = (k * k + 2 if cfg.route(k) == "gram" else 3) * 2 + QK_TERMS * heads_per_layer
    layers = layout.evaluated_layers
    tp_bytes = 8 * (layers * per_layer_tp + 1) if layout.tp > 1 else 0
    krylov_bytes = 0
    if cfg.route(k) == "krylov" and layout.tp > 1:
        krylov_bytes = 8 * cfg.krylov_steps * cfg.krylov_block * 2 * k * layers
    names_per_layer = METRICS_PER_LAYER_DW + QK_TERMS * (2 + heads_per_layer)
    dp_bytes = 8 * (layout.stage_layers * names_per_layer + 1) if layout.dp > 1 else 0
    router_names = 16 if layout.experts else 0
    pp_values = layout.layers * (names_per_layer + router_names * 2)   # metric + numeric detail fields
    pp_bytes = 8 * (pp_values + 1) if layout.pp > 1 else 0
    return {"tp_reduce_bytes": tp_bytes, "krylov_bytes": krylov_bytes, "krylov_collectives":
            cfg.krylov_steps if krylov_bytes else 0, "dp_combine_bytes": dp_bytes, "pp_exchange_bytes": pp_bytes}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--quick", action="store_true", help="hidden ÷ 8, heads ÷ 8: a smoke check")
    parser.add_argument("--force", action="store_true", help="time even on a loaded machine (marked loaded)")
    parser.add_argument("--record", action="store_true", help="write results/frontier_shards.{md,json}")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    load = check_idle(force=args.force)
    rows = []
    for key in args.layouts:
        layout = dataclasses.replace(LAYOUTS[key])
        if args.quick:
            layout = dataclasses.replace(layout, hidden=layout.hidden // 8, heads=max(layout.tp, layout.heads // 8),
                                         groups=max(layout.tp, layout.groups // 8),
                                         tokens_per_step=layout.tokens_per_step // 64)
        cfg = AttentionMonitorConfig(interval=10)
        attention = time_attention(layout, interval=10)
        router = time_router(layout)
        comm = communication(layout, cfg)
        per_eval = attention["evaluation_s"] + router.get("router_s", 0.0)
        overhead = {f"delta{d}": per_eval / (d * layout.step_seconds) for d in (10, 100)}
        row = {"layout": dataclasses.asdict(layout), "attention": attention, "router": router, "comm": comm,
               "per_evaluation_s": per_eval, "overhead": overhead}
        rows.append(row)
        log.info(f"{layout.name}: {attention['layers_evaluated']} layer(s) evaluated on the busiest rank, route "
                 f"{attention['routes']}, evaluation {attention['evaluation_s']:.2f} s (measured), snapshot "
                 f"{attention['snapshot_bytes'] / 2**20:.1f} MiB, router {router.get('router_s', 0):.2f} s, "
                 f"comm TP {comm['tp_reduce_bytes'] / 2**20:.2f} MiB + Krylov {comm['krylov_bytes'] / 2**20:.2f} MiB, "
                 f"DP {comm['dp_combine_bytes'] / 2**10:.1f} KiB, PP {comm['pp_exchange_bytes'] / 2**10:.1f} KiB; "
                 f"overhead δ=10 {100 * overhead['delta10']:.3f} %, δ=100 {100 * overhead['delta100']:.4f} % "
                 f"(step {layout.step_seconds:.1f} s, derived)")
    if args.record:
        lines = [f"Machine load at start: {load['load1']:.2f} on {load['cores']} cores"
                 + (" (LOADED: timings unreliable)" if load["loaded"] else "") + ".", "",
                 "| layout | layers evaluated / rank | ΔW route | evaluation s (measured, CPU) | router s (measured) | "
                 "snapshot MiB/rank (measured) | TP MiB | Krylov MiB | DP KiB | PP KiB (derived) | step s (derived) | "
                 "overhead δ=10 | δ=100 (derived) |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            a, c, lay = r["attention"], r["comm"], r["layout"]
            lines.append(f"| {lay['name']} | {a['layers_evaluated']} | {','.join(a['routes'])} | "
                         f"{a['evaluation_s']:.2f} | {r['router'].get('router_s', 0):.2f} | "
                         f"{a['snapshot_bytes'] / 2**20:.1f} | {c['tp_reduce_bytes'] / 2**20:.2f} | "
                         f"{c['krylov_bytes'] / 2**20:.2f} | {c['dp_combine_bytes'] / 2**10:.1f} | "
                         f"{c['pp_exchange_bytes'] / 2**10:.1f} | {lay['step_seconds']:.1f} | "
                         f"{100 * r['overhead']['delta10']:.3f} % | {100 * r['overhead']['delta100']:.4f} % |")
        lines += ["", "Step times: " + "; ".join(f"{r['layout']['name']}: {r['layout']['step_source']}" for r in rows)]
        path = write_results("frontier_shards", "\n".join(lines), {"rows": rows, "load": load})
        log.info(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
