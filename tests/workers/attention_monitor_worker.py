"""torchrun worker (2 ranks, gloo): AttentionEvaluator under tensor parallelism TP=2.

Every rank builds the same full fused ``linear_qkv`` weights (two layers: GQA H=4/G=2 and MHA H=G=4) and two
extra linears (ColumnParallel fc1 split by rows, RowParallel fc2 split by columns), takes its TP shard (whole
query groups, as Megatron does: ``layouts.qkv_partition_sizes``), and applies the same full-weight updates to
its shard. A reference monitor on the *full* weights runs in the same process over a one-rank group (TP=1, no
communication). Checks, on every rank:

* global scope: metrics (same names) equal the TP=1 metrics to 1e-10 — dwq/dwk spectra of the whole matrices,
  every head's Δ1/Δ2/Δ3 entropy (heads of both ranks), aggregates, extra linears; details equal too;
  collectives: construction = 1 all_reduce + 1 all_gather; 0 on non-evaluation steps; exactly 1 all_reduce per
  evaluation (one per unit with tiny ``bucket_mb``, same values);
* slice scope: no collective at all; ``attn/layer{L}/tp{r}/dw*`` equal a numpy SVD of the shard's ΔW; the
  rank's own heads equal the global-scope head metrics;
* a NaN in rank 1's shard: NaN dwq metrics on both ranks, rank 0's heads stay finite;
* state_dict / load_state_dict round trip per rank continues exactly; a rank missing snapshots makes every
  rank drop them (no hang);
* inconsistent construction (layer counts, head offsets, a local error on one rank) raises ValueError on every
  rank without hanging.

Rank 0 prints ``ATTENTION_MONITOR PASS`` when every rank passed.
"""
from __future__ import annotations

import io
import math
import sys
import warnings

import numpy as np
import torch
import torch.distributed as dist

from megatron_mech.core.layouts import qkv_partition_sizes
from megatron_mech.monitors import AttentionLayer, AttentionEvaluator, AttentionMonitorConfig
from verdict import count_collectives, finish  # tests/workers/, the script's directory

D_MODEL, HEAD_DIM, FFN, TP = 16, 4, 24, 2


def exact_config(**kwargs) -> AttentionMonitorConfig:
    """float64 Grams: the route compared against float64 dense references at ~1e-10 (the float32 default is
    checked against it separately, within its stated accuracy)."""
    return AttentionMonitorConfig(gram_dtype="float64", **kwargs)
LAYERS = {0: (4, 2), 3: (4, 4)}          # layer -> (heads, groups), full model
INTERVAL, STEPS = 3, 9


def shard_rows(full: torch.Tensor, heads: int, groups: int, rank: int) -> torch.Tensor:
    """The TP shard of a fused weight: the rows of this rank's whole query groups."""
    _, g_local = qkv_partition_sizes(heads, groups, TP)
    return full.view(groups, -1, full.shape[1])[rank * g_local:(rank + 1) * g_local].reshape(-1, full.shape[1])


def np_dw(delta: np.ndarray) -> dict[str, float]:
    sv = np.linalg.svd(delta, compute_uv=False)
    p = sv ** 2 / (sv ** 2).sum()
    p = p[p > 0]
    h = float(-(p * np.log(p)).sum())
    return {"entropy": h / math.log(len(sv)), "effective_rank": math.exp(h),
            "stable_rank": float((sv ** 2).sum() / sv[0] ** 2), "fro": float(np.linalg.norm(delta))}


class Model:
    """Full weights (reference, TP=1) and this rank's shards, updated identically."""

    def __init__(self, rank: int):
        gen = torch.Generator().manual_seed(7)
        self.rank = rank
        self.full = {L: torch.randn((h + 2 * g) * HEAD_DIM, D_MODEL, generator=gen) * 0.1
                     for L, (h, g) in LAYERS.items()}
        self.full_fc1 = torch.randn(FFN, D_MODEL, generator=gen) * 0.1
        self.full_fc2 = torch.randn(D_MODEL, FFN, generator=gen) * 0.1
        self.shard = {L: shard_rows(w, *LAYERS[L], rank).clone() for L, w in self.full.items()}
        self.shard_fc1 = self.full_fc1.chunk(TP, dim=0)[rank].clone()
        self.shard_fc2 = self.full_fc2.chunk(TP, dim=1)[rank].clone()
        self.gen = torch.Generator().manual_seed(11)

    def step(self):
        with torch.no_grad():
            for L, w in self.full.items():
                u = 1e-3 * torch.randn(w.shape[0], 2, generator=self.gen) @ torch.randn(2, D_MODEL, generator=self.gen)
                u += 1e-4 * torch.randn(w.shape, generator=self.gen)
                w += u
                self.shard[L] += shard_rows(u, *LAYERS[L], self.rank)
            u1 = 1e-3 * torch.randn(self.full_fc1.shape, generator=self.gen)
            u2 = 1e-3 * torch.randn(self.full_fc2.shape, generator=self.gen)
            self.full_fc1 += u1
            self.full_fc2 += u2
            self.shard_fc1 += u1.chunk(TP, dim=0)[self.rank]
            self.shard_fc2 += u2.chunk(TP, dim=1)[self.rank]

    def full_layers(self):
        return [AttentionLayer(L, self.full[L], h, g, HEAD_DIM) for L, (h, g) in LAYERS.items()]

    def shard_layers(self, offsets=None):
        out = []
        for L, (h, g) in LAYERS.items():
            h_loc, g_loc = qkv_partition_sizes(h, g, TP)
            off = self.rank * h_loc if offsets is None else offsets
            out.append(AttentionLayer(L, self.shard[L], h_loc, g_loc, HEAD_DIM, head_offset=off))
        return out

    def full_extras(self):
        return {"fc1": (self.full_fc1, 0), "fc2": (self.full_fc2, 1)}

    def shard_extras(self):
        return {"fc1": (self.shard_fc1, 0), "fc2": (self.shard_fc2, 1)}


def main() -> int:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == TP, "this worker expects --nproc_per_node=2"
    singles = [dist.new_group([r]) for r in range(world)]      # one-rank groups: TP=1 reference, no comms
    calls, real = count_collectives(("all_reduce", "all_gather", "broadcast", "all_gather_into_tensor"))
    errors: list[str] = []

    def expect(cond: bool, msg: str):
        if not cond:
            errors.append(msg)

    def close(a: float, b: float, tol: float = 1e-10) -> bool:
        return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=tol, abs_tol=tol)

    # ---------------------------------------------------------------- global scope vs TP=1, slice scope
    model = Model(rank)
    cfg = exact_config(interval=INTERVAL)
    reference = AttentionEvaluator(model.full_layers(), cfg, tp_group=singles[rank], extra_linears=model.full_extras())
    calls.clear()
    monitor = AttentionEvaluator(model.shard_layers(), cfg, extra_linears=model.shard_extras())
    expect(sorted(calls) == ["all_gather", "all_reduce"], f"construction collectives {calls}")
    bucketed = AttentionEvaluator(model.shard_layers(), exact_config(interval=INTERVAL, bucket_mb=1e-6),
                                extra_linears=model.shard_extras())
    calls.clear()
    sliced = AttentionEvaluator(model.shard_layers(), exact_config(interval=INTERVAL, dw_scope="slice"),
                              extra_linears=model.shard_extras())
    expect(calls == [], f"slice construction collectives {calls}")

    shard_hist = {}
    n_evals = 0
    for step in range(STEPS + 1):
        if step:
            model.step()
        shard_hist[step] = ({L: w.clone() for L, w in model.shard.items()}, model.shard_fc1.clone(),
                            model.shard_fc2.clone())
        want = reference.observe(step)
        calls.clear()
        got = monitor.observe(step)
        expect(calls == (["all_reduce"] if want is not None else []), f"step {step}: global collectives {calls}")
        calls.clear()
        got_b = bucketed.observe(step)
        expect(len(calls) == (5 if want is not None else 0), f"step {step}: bucketed collectives {calls}")
        calls.clear()
        got_s = sliced.observe(step)
        expect(calls == [], f"step {step}: slice collectives {calls}")
        if want is None:
            expect(got is None and got_b is None and got_s is None, f"step {step}: unexpected evaluation")
            continue
        n_evals += 1
        (wm, wd), (gm, gd), (bm, _), (sm, sd) = want, got, got_b, got_s
        expect(set(gm) == set(wm), f"step {step}: names differ: {sorted(set(gm) ^ set(wm))}")
        expect(gd == wd, f"step {step}: details differ")
        for name, value in wm.items():
            expect(name in gm and close(gm[name], value), f"step {step}: {name} {gm.get(name)} != TP=1 {value}")
            expect(name in bm and close(bm[name], value), f"step {step}: bucketed {name} {bm.get(name)} != {value}")
        expect(len([n for n in gm if "/head" in n]) == 3 * (4 + 4), f"step {step}: not every head present")
        # slice scope: per-shard ΔW from numpy, own heads equal the global ones
        prev, cur = shard_hist[step - INTERVAL], shard_hist[step]
        for L, (h, g) in LAYERS.items():
            h_loc, g_loc = qkv_partition_sizes(h, g, TP)
            grouped = lambda w: w.double().view(g_loc, h_loc // g_loc + 2, HEAD_DIM, D_MODEL)  # noqa: E731
            for tag, sel in (("q", lambda x: x[:, :-2]), ("k", lambda x: x[:, -2])):
                delta = (sel(grouped(cur[0][L])) - sel(grouped(prev[0][L]))).reshape(-1, D_MODEL).numpy()
                for what, v in np_dw(delta).items():
                    name = f"attn/layer{L}/tp{rank}/dw{tag}_{what}"
                    expect(name in sm and close(sm[name], v, 1e-9), f"step {step}: slice {name} {sm.get(name)} != {v}")
                    expect(sd.get(name, {}).get("tp_rank") == rank, f"slice details {name}")
            for hh in range(rank * h_loc, (rank + 1) * h_loc):
                for term in ("delta1", "delta2", "delta3"):
                    name = f"attn/layer{L}/head{hh}/{term}_entropy"
                    expect(name in sm and close(sm[name], gm[name]), f"step {step}: slice {name}")
            other = (1 - rank) * h_loc
            expect(f"attn/layer{L}/head{other}/delta2_entropy" not in sm, "slice scope reports another rank's heads")
        for name, i in (("fc1", 1), ("fc2", 2)):
            for what, v in np_dw((cur[i].double() - prev[i].double()).numpy()).items():
                key = f"linear/{name}/tp{rank}/dw_{what}"
                expect(key in sm and close(sm[key], v, 1e-9), f"slice {key} {sm.get(key)} != {v}")
    expect(n_evals == STEPS // INTERVAL, f"{n_evals} evaluations")

    # ---------------------------------------------------------------- state round trip (per rank)
    buf = io.BytesIO()
    torch.save(monitor.state_dict(), buf)
    buf.seek(0)
    resumed = AttentionEvaluator(model.shard_layers(), cfg, extra_linears=model.shard_extras())
    calls.clear()
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    expect(calls == ["all_reduce"], f"load_state_dict collectives {calls}")
    for step in range(STEPS + 1, STEPS + INTERVAL + 1):
        model.step()
        want, got, got_r = reference.observe(step), monitor.observe(step), resumed.observe(step)
    expect(got is not None and got_r is not None and got[0] == got_r[0], "resumed monitor diverged")
    expect(all(close(got[0][n], v) for n, v in want[0].items()), "post-resume metrics differ from TP=1")
    # one rank without snapshots: both drop them, nobody hangs
    state = resumed.state_dict()
    if rank == 1:
        state = dict(state, snapshots=None, step=None)
    again = AttentionEvaluator(model.shard_layers(), cfg, extra_linears=model.shard_extras())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again.load_state_dict(state)
    expect(again.snapshot_step is None and any("dropping" in str(w.message) for w in caught),
           f"mismatched load: snapshot_step {again.snapshot_step}")

    # ---------------------------------------------------------------- NaN in rank 1's shard only
    step = STEPS + 2 * INTERVAL
    model.step()
    if rank == 1:
        with torch.no_grad():
            model.shard[0][0, 3] = math.nan       # rank 1, layer 0: first query head of its group (global head 2)
    metrics, _ = monitor.observe(step)
    expect(all(math.isnan(metrics[f"attn/layer0/dwq_{w}"]) for w in ("entropy", "stable_rank", "fro")),
           "NaN in rank 1's shard did not make dwq NaN")
    expect(math.isfinite(metrics["attn/layer0/dwk_entropy"]), "dwk should stay finite")
    expect(math.isnan(metrics["attn/layer0/head2/delta2_entropy"]), "head 2 should be NaN")
    expect(all(math.isfinite(metrics[f"attn/layer0/head{h}/delta2_entropy"]) for h in (0, 1, 3)),
           "other heads should stay finite")
    expect(math.isfinite(metrics["attn/layer3/dwq_entropy"]), "layer 3 should stay finite")

    # ---------------------------------------------------------------- inconsistent construction
    def raises(fn, pattern: str, label: str):
        try:
            fn()
        except ValueError as exc:
            expect(pattern in str(exc), f"{label}: wrong message {exc}")
            return
        errors.append(f"{label}: no ValueError")

    layers = model.shard_layers()
    raises(lambda: AttentionEvaluator(layers if rank == 0 else layers[:1], cfg), "number of layers", "layer count")
    raises(lambda: AttentionEvaluator(model.shard_layers(offsets=0), cfg), "tile", "head offsets")
    bad_local = [layers[0], layers[0]] if rank == 0 else layers
    raises(lambda: AttentionEvaluator(bad_local, cfg), "duplicate" if rank == 0 else "another tensor-parallel rank",
           "local error")
    raises(lambda: AttentionEvaluator(layers, AttentionMonitorConfig(interval=INTERVAL + rank)), "interval",
           "interval mismatch")

    return finish(errors, "ATTENTION_MONITOR", f"TP={world}, {n_evals} evaluations", real["all_reduce"])


if __name__ == "__main__":
    sys.exit(main())
