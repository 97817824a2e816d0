"""Our monitor math against the closest public peer's formulas, side by side in one process.

The peer (bo-ke/llm-internal-medicine) is Paddle-only; what is timed here is our own torch reading of the
formulas its description gives (nothing of its code is used):

* ΔW spectral entropy: the Gram ΔWᵀΔW in float32, ``eigvalsh`` in float32, p ∝ σ (its σ¹ weighting) and,
  for comparison with ours, p ∝ σ².
* Δ2 per head: the factors A = [ΔW_q, W_q], B = [W_k, ΔW_k] (no balancing), their Grams in float32, a
  float32 Cholesky factor L of AᵀA and ``eigvalsh(Lᵀ·BᵀB·L)`` in float32, one head at a time.
* Routing entropy: ``-Σ softmax(z)·log(softmax(z) + 1e-12)`` in float32.

Ours: :func:`megatron_mech.core.sharded.shard_gram` (lower triangle only) + ``spectrum_from_shard_grams`` (the
monitor's ΔW route, through its float64 reduce buffer: float32 Gram and eigenproblem for float32 weights),
:func:`megatron_mech.core.spectral.qk_increment_spectra` (Δ2 only: three float32 d_head-wide block Grams —
the symmetric two by their lower block rows — balanced, unit-scaled float32 r×r cores) and
:func:`megatron_mech.core.router_statistics.routing_entropy` (one softmax pass on floored shifted logits). Batched rows:
the per-head r×r eigenproblems of several layers through
:func:`megatron_mech.core.spectral.spectra_from_qk_cores` — one call per head, one per layer, one for all — and a
multi-layer Δ2 evaluation, the peer head by head against ours grouped as the monitor's default groups it (per
layer on a CPU).

Accuracy is measured against float64 dense references (SVD of ΔW, of the d×d Δ2 product; the float64
entropy formula). Timings are best of ``--repeats``, the two implementations interleaved. The Δ2 Gram route
is also compared with the GEMM bound: the FLOPs of the full [2·d_head]² Grams per head and per K group
(``4·(2·d_head)²·d_model`` per head pair with MHA, the conventional bound) at the float32 GEMM rate this
machine reaches (a 2048³ matmul, timed here).

    python benchmarks/peer_side_by_side.py --record          # full sizes, writes results/peer_side_by_side.*
    python benchmarks/peer_side_by_side.py --quick --force   # tiny sizes, a smoke check (nothing written)

Refuses to time on a loaded machine (``os.getloadavg``) unless ``--force``.
"""
from __future__ import annotations

import argparse
import logging
import math
import time

import torch

from megatron_mech.core.router_statistics import routing_entropy
from megatron_mech.core.sharded import shard_gram, spectrum_from_shard_grams
from megatron_mech.core.spectral import (
    QK_TERMS,
    matrix_spectrum,
    qk_increment_cores,
    qk_increment_spectra,
    spectra_from_qk_cores,
    spectral_entropy,
)

try:
    from _results import check_idle, write_results
except ImportError:  # run as a module
    from benchmarks._results import check_idle, write_results

log = logging.getLogger("peer_side_by_side")


def best_time(fn, repeats: int) -> float:
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def interleaved(fns: dict, repeats: int) -> dict:
    """Best time of each function, the functions called in turn ``repeats`` times (load drifts hit all alike)."""
    best = {k: math.inf for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            best[k] = min(best[k], best_time(fn, 1))
    return best


# ------------------------------------------------------------------------------------ the peer's formulas
def peer_dw_entropy(delta: torch.Tensor, power: float) -> torch.Tensor:
    """ΔW [m, n] float32 → normalised entropy of p ∝ σ^power, from a float32 Gram and float32 eigvalsh."""
    x = delta.float()
    gram = x.T @ x if x.shape[0] >= x.shape[1] else x @ x.T
    sv = torch.linalg.eigvalsh(gram).clamp_min(0).sqrt()
    w = sv.pow(power)
    p = w / w.sum()
    return -(p * torch.log(p + 1e-12)).sum() / math.log(sv.numel())


def peer_delta2_spectra(wq_prev, wk_prev, wq, wk) -> torch.Tensor:
    """Per-head Δ2 singular values, float32 throughout, one head at a time. Inputs [H, d, dh] (MHA)."""
    out = []
    for h in range(wq.shape[0]):
        a = torch.cat([wq[h] - wq_prev[h], wq_prev[h]], dim=1).float()
        b = torch.cat([wk_prev[h], wk[h] - wk_prev[h]], dim=1).float()
        ga, gb = a.T @ a, b.T @ b
        factor = torch.linalg.cholesky_ex(ga).L
        core = factor.T @ gb @ factor
        out.append(torch.linalg.eigvalsh(core).clamp_min(0).sqrt().flip(-1))
    return torch.stack(out)


def peer_routing_entropy(logits: torch.Tensor) -> torch.Tensor:
    p = torch.softmax(logits.float(), dim=-1)
    return -(p * torch.log(p + 1e-12)).sum(-1)


# ------------------------------------------------------------------------------------ ours
def our_dw_entropy(delta: torch.Tensor) -> torch.Tensor:
    k = min(delta.shape)
    shard_dim = 0 if delta.shape[0] >= delta.shape[1] else 1
    packed = shard_gram(delta, shard_dim, accumulate_dtype=torch.float32, lower_only=True).double()
    return spectral_entropy(spectrum_from_shard_grams(packed, k, eig_dtype=torch.float32))


def our_delta2(wq_prev, wk_prev, wq, wk) -> torch.Tensor:
    return qk_increment_spectra(wq_prev, wk_prev, wq, wk, terms=("delta2",)).delta2


def our_delta2_layers(layers, batch: str = "auto") -> list:
    """Δ2 of several layers as the monitor evaluates them: the cores layer by layer, the eigenproblems grouped
    as the monitor's default groups them (``auto``: per layer on a CPU, all layers at once elsewhere)."""
    cores = [qk_increment_cores(*w, terms=("delta2",)) for w in layers]
    return [s.delta2 for s in spectra_from_qk_cores(cores, batch=batch)]


# ------------------------------------------------------------------------------------ cases
def make_qk(heads: int, d_model: int, d_head: int, low_rank: bool, seed: int = 0):
    """Float32 weights (paper orientation [H, d, dh]) and a step 1e-3 of them: full rank, or rank 2 per head."""
    g = torch.Generator().manual_seed(seed)
    scale = d_model ** -0.5
    wq = torch.randn(heads, d_model, d_head, generator=g) * scale
    wk = torch.randn(heads, d_model, d_head, generator=g) * scale

    def step(w):
        if low_rank:
            return w + 1e-3 * scale * (torch.randn(heads, d_model, 2, generator=g)
                                       @ torch.randn(heads, 2, d_head, generator=g))
        return w + 1e-3 * scale * torch.randn(w.shape, generator=g)
    return wq, wk, step(wq), step(wk)


def make_delta(d: int, low_rank: bool, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if low_rank:  # a collapsed update: a few directions plus a little noise
        return (torch.randn(d, 4, generator=g) @ torch.randn(4, d, generator=g)
                + 1e-3 * torch.randn(d, d, generator=g)) * 1e-3
    return torch.randn(d, d, generator=g) * 1e-3


def gemm_gflops(dtype: torch.dtype, n: int = 2048, repeats: int = 5) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    return 2 * n ** 3 / best_time(lambda: a @ b, repeats) / 1e9


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dw-size", type=int, default=4096, help="ΔW is dw-size × dw-size")
    parser.add_argument("--d-model", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=8, help="heads for the Δ2 side-by-side")
    parser.add_argument("--bound-heads", type=int, default=2, help="heads for the GEMM-bound check")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=8, help="layers of the batched rows")
    parser.add_argument("--layer-d-model", type=int, default=1024, help="d_model of the batched rows")
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke check of the script")
    parser.add_argument("--force", action="store_true", help="time even on a loaded machine (marked loaded)")
    parser.add_argument("--record", action="store_true", help="write results/peer_side_by_side.{md,json}")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.quick:
        args.dw_size, args.d_model, args.head_dim, args.tokens, args.repeats = 256, 256, 32, 4096, 2
        args.layers, args.layer_d_model = 3, 128
    load = check_idle(force=args.force)
    rows = []
    # B023 below: interleaved() calls its lambdas before returning, so they see the current iteration's tensors.

    # ΔW entropy
    for low_rank in (False, True):
        delta = make_delta(args.dw_size, low_rank)
        ref_sv = matrix_spectrum(delta.double())
        ref = {p: float(spectral_entropy(ref_sv, power=p)) for p in (1.0, 2.0)}
        t = interleaved({"peer": lambda: peer_dw_entropy(delta, 2.0),  # noqa: B023
                         "ours": lambda: our_dw_entropy(delta)}, args.repeats)  # noqa: B023
        rows.append({"computation": f"ΔW entropy, d={args.dw_size}, {'low-rank' if low_rank else 'full-rank'}",
                     "peer_s": t["peer"], "ours_s": t["ours"], "ratio": t["peer"] / t["ours"],
                     "err_ours": abs(float(our_dw_entropy(delta)) - ref[2.0]),
                     "err_peer": abs(float(peer_dw_entropy(delta, 2.0)) - ref[2.0]),
                     "err_peer_sigma1": abs(float(peer_dw_entropy(delta, 1.0)) - ref[1.0]) / ref[1.0]})

    # Δ2 per head
    for low_rank in (False, True):
        w = make_qk(args.heads, args.d_model, args.head_dim, low_rank)
        w64 = [x.double() for x in w]
        dense = ((w64[2][:1] - w64[0][:1]) @ w64[1][:1].transpose(1, 2)
                 + w64[0][:1] @ (w64[3][:1] - w64[1][:1]).transpose(1, 2))
        ref = float(spectral_entropy(matrix_spectrum(dense)[:, : 2 * args.head_dim])[0])
        t = interleaved({"peer": lambda: peer_delta2_spectra(*w), "ours": lambda: our_delta2(*w)},  # noqa: B023
                        args.repeats)
        rows.append({"computation": f"Δ2, {args.heads} heads, d={args.d_model}, {'rank-2' if low_rank else 'full-rank'}"
                                    " step", "peer_s": t["peer"], "ours_s": t["ours"], "ratio": t["peer"] / t["ours"],
                     "err_ours": abs(float(spectral_entropy(our_delta2(*[x[:1] for x in w]))[0]) - ref),
                     "err_peer": abs(float(spectral_entropy(peer_delta2_spectra(*[x[:1] for x in w]))[0]) - ref)})

    # routing entropy
    for spread in (2.0, 50.0):
        g = torch.Generator().manual_seed(2)
        logits = spread * torch.randn(args.tokens, args.experts, generator=g)
        z = logits.double()
        ref = -(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum(-1)
        t = interleaved({"peer": lambda: peer_routing_entropy(logits),  # noqa: B023
                         "ours": lambda: routing_entropy(logits)}, args.repeats)  # noqa: B023
        rows.append({"computation": f"routing entropy, {args.tokens}×{args.experts}, {spread:g}·randn",
                     "peer_s": t["peer"], "ours_s": t["ours"], "ratio": t["peer"] / t["ours"],
                     "err_ours": float((routing_entropy(logits).double() - ref).abs().max()),
                     "err_peer": float((peer_routing_entropy(logits).double() - ref).abs().max())})

    # Batched evaluation: the per-head r×r eigenproblems of several layers (three terms, as the monitor runs)
    layers = [make_qk(args.heads, args.layer_d_model, args.head_dim, False, seed=10 + i) for i in range(args.layers)]
    cores = [qk_increment_cores(*w, terms=QK_TERMS) for w in layers]
    modes = {m: (lambda m=m: spectra_from_qk_cores(cores, batch=m)) for m in ("head", "item", "all")}
    t = interleaved(modes, args.repeats)
    spectra = {m: fn() for m, fn in modes.items()}
    mode_err = max(float((spectral_entropy(getattr(a, term)) - spectral_entropy(getattr(b, term))).abs().max())
                   for m in ("item", "all") for a, b in zip(spectra[m], spectra["head"]) for term in QK_TERMS)
    batched = {"what": f"QK cores (Δ1, Δ2, Δ3), {args.layers} layers × {args.heads} heads, r = 2·{args.head_dim}",
               "per_head_s": t["head"], "per_layer_s": t["item"], "all_s": t["all"],
               "max_entropy_diff": mode_err}
    # ... and a multi-layer Δ2 evaluation: the peer head by head, ours as the monitor groups it by default
    t = interleaved({"peer": lambda: [peer_delta2_spectra(*w) for w in layers],
                     "ours": lambda: our_delta2_layers(layers)}, args.repeats)
    w64 = [x.double() for x in layers[0]]
    dense = ((w64[2][:1] - w64[0][:1]) @ w64[1][:1].transpose(1, 2)
             + w64[0][:1] @ (w64[3][:1] - w64[1][:1]).transpose(1, 2))
    ref = float(spectral_entropy(matrix_spectrum(dense)[:, : 2 * args.head_dim])[0])
    rows.append({"computation": f"Δ2, {args.layers} layers × {args.heads} heads, d={args.layer_d_model}, the "
                                "monitor's grouping",
                 "peer_s": t["peer"], "ours_s": t["ours"], "ratio": t["peer"] / t["ours"],
                 "err_ours": abs(float(spectral_entropy(our_delta2_layers(layers)[0][:1])[0]) - ref),
                 "err_peer": abs(float(spectral_entropy(peer_delta2_spectra(*[x[:1] for x in layers[0]]))[0]) - ref)})

    # Δ2 Gram route against the float32 GEMM bound
    rate32 = gemm_gflops(torch.float32)
    w = make_qk(args.bound_heads, args.d_model, args.head_dim, False)
    ours = best_time(lambda: our_delta2(*w), args.repeats)
    full_flops = 2 * args.bound_heads * 2 * (2 * args.head_dim) ** 2 * args.d_model   # q and k Grams, [2dh]²
    bound = {"heads": args.bound_heads, "d_model": args.d_model, "gemm_gflops_f32": rate32,
             "full_gram_gflop": full_flops / 1e9, "bound_s": full_flops / (rate32 * 1e9), "ours_s": ours}
    bound["ratio_to_bound"] = ours / bound["bound_s"]
    # the FLOPs it forms: ΔWᵀ-type block whole, the two symmetric blocks by their lower block rows (3/4 each)
    symmetric = 0.75 if args.head_dim // 2 >= 32 else 1.0      # (narrow heads: one GEMM per block)
    bound["own_flops_bound_s"] = (1 + 2 * symmetric) / 4 * bound["bound_s"]
    bound["ratio_to_own_flops"] = ours / bound["own_flops_bound_s"]
    # the two stages apart, same weights: the block Grams (and ΔW) that the bound prices, and the r × r
    # eigenproblems (Cholesky, core product, eigvalsh) that it does not
    cores = qk_increment_cores(*w, terms=("delta2",))
    bound["cores_s"] = best_time(lambda: qk_increment_cores(*w, terms=("delta2",)), args.repeats)
    bound["eigen_s"] = best_time(lambda: spectra_from_qk_cores([cores]), args.repeats)

    for r in rows:
        log.info(f"{r['computation']:55s} peer {r['peer_s'] * 1e3:9.2f} ms  ours {r['ours_s'] * 1e3:9.2f} ms  "
                 f"peer/ours {r['ratio']:5.2f}  |err| ours {r['err_ours']:.1e} peer {r['err_peer']:.1e}"
                 + (f"  peer σ¹ rel err {r['err_peer_sigma1']:.1e}" if "err_peer_sigma1" in r else ""))
    log.info(f"Δ2 Gram route, {args.bound_heads} heads, d={args.d_model}: {ours * 1e3:.1f} ms; full-Gram bound "
             f"{bound['full_gram_gflop']:.2f} GFLOP at {rate32:.0f} GFLOP/s = {bound['bound_s'] * 1e3:.1f} ms; "
             f"ratio {bound['ratio_to_bound']:.2f} ({bound['ratio_to_own_flops']:.2f} to the FLOPs it forms)")
    log.info(f"  apart: block Grams and ΔW {bound['cores_s'] * 1e3:.1f} ms, r×r eigenproblems "
             f"{bound['eigen_s'] * 1e3:.1f} ms")
    log.info(f"{batched['what']}: per head {batched['per_head_s'] * 1e3:.1f} ms, per layer "
             f"{batched['per_layer_s'] * 1e3:.1f} ms, all layers batched {batched['all_s'] * 1e3:.1f} ms; max "
             f"entropy difference between modes {batched['max_entropy_diff']:.1e}")
    if args.record:
        lines = [f"Machine load at start: {load['load1']:.2f} on {load['cores']} cores"
                 + (" (LOADED: timings unreliable)" if load["loaded"] else "") + ".", "",
                 "| computation | peer ms | ours ms | peer / ours | |entropy err| ours | peer |",
                 "|---|---|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {r['computation']} | {r['peer_s'] * 1e3:.2f} | {r['ours_s'] * 1e3:.2f} | "
                         f"{r['ratio']:.2f} | {r['err_ours']:.1e} | {r['err_peer']:.1e}"
                         + (f" (σ¹ variant: {r['err_peer_sigma1']:.1%} relative)" if "err_peer_sigma1" in r else "")
                         + " |")
        lines += ["", f"Δ2 Gram route vs the float32 GEMM bound: {bound['heads']} heads, d={bound['d_model']}: "
                  f"{bound['ours_s'] * 1e3:.1f} ms; the full [2·d_head]² Grams are {bound['full_gram_gflop']:.2f} "
                  f"GFLOP = {bound['bound_s'] * 1e3:.1f} ms at the {bound['gemm_gflops_f32']:.0f} GFLOP/s of a "
                  f"float32 2048³ matmul here: ratio {bound['ratio_to_bound']:.2f} (ours forms 3 of the 4 blocks, "
                  "the two symmetric ones by their lower block rows: 62.5 % of those FLOPs; "
                  f"{bound['ratio_to_own_flops']:.2f} to the bound of its own FLOPs, the rest being ΔW and the "
                  f"float32 r×r cores). Apart, in the same run: the block Grams and ΔW {bound['cores_s'] * 1e3:.1f} "
                  f"ms ({bound['cores_s'] / bound['own_flops_bound_s']:.2f}× the bound of their FLOPs), the r×r "
                  f"eigenproblems {bound['eigen_s'] * 1e3:.1f} ms = {bound['eigen_s'] / bound['bound_s']:.2f} of the "
                  f"whole bound: with the Grams at the GEMM rate, the route would still take "
                  f"{(bound['own_flops_bound_s'] + bound['eigen_s']) / bound['bound_s']:.2f}× the bound.",
                  "", f"Batched eigenproblems, {batched['what']}, float32 cores: one call per head "
                  f"{batched['per_head_s'] * 1e3:.1f} ms, one per layer {batched['per_layer_s'] * 1e3:.1f} ms, one "
                  f"for all layers {batched['all_s'] * 1e3:.1f} ms (per head / all = "
                  f"{batched['per_head_s'] / batched['all_s']:.2f}, per layer / all = "
                  f"{batched['per_layer_s'] / batched['all_s']:.2f}); largest entropy difference between the modes "
                  f"{batched['max_entropy_diff']:.1e}.",
                  "", "Entropy errors are against float64 dense references (SVD of ΔW, of the d×d Δ2 product, the "
                  "float64 routing formula); the detector's levels are drops of 0.01 (Δ2) and 0.02 (ΔW) in "
                  "normalised entropy."]
        path = write_results("peer_side_by_side", "\n".join(lines), {"rows": rows, "bound": bound, "batched": batched,
                                                                      "load": load})
        log.info(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
