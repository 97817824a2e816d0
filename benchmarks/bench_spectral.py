"""Δ2 spectra: compressed cores (Gram and QR) vs dense d_model × d_model decompositions, side by side.

For each d_model: per-head Δ2 = ΔW_q W_kᵀ + W_q ΔW_kᵀ of 4 heads (d_head 128, float32) computed
  * compressed, method "gram" (float64 Grams + r×r eigenproblems, the default),
  * compressed, method "qr" (thin QR in float32, the paper's route),
  * dense: SVD of the d×d product (torch.linalg.svdvals), and eigvalsh of its d×d Gram,
all in the same process, interleaved, best of --repeats. Accuracy is measured on head 0 against a float64
dense reference (SVD of the float64 d×d product), for a full-rank random increment and a rank-deficient one.

    python benchmarks/bench_spectral.py                       # default sizes 1024 2048 4096
    python benchmarks/bench_spectral.py --sizes 256 512       # quick
"""
from __future__ import annotations

import argparse
import time

import torch

from megatron_mech.core.spectral import matrix_spectrum, qk_increment_spectra, spectral_entropy

try:
    from _results import write_results
except ImportError:  # run as a module
    from benchmarks._results import write_results


def make_case(d_model, heads, d_head, rank_deficient, seed=0):
    g = torch.Generator().manual_seed(seed)
    scale = d_model ** -0.5
    wq = torch.randn(heads, d_model, d_head, generator=g) * scale
    wk = torch.randn(heads, d_model, d_head, generator=g) * scale
    if rank_deficient:  # a collapsed update: rank-2 increments per head (the fault signature)
        def step(w):
            u = torch.randn(heads, d_model, 2, generator=g)
            v = torch.randn(heads, 2, d_head, generator=g)
            return w + 1e-3 * scale * (u @ v)
    else:
        def step(w):
            return w + 1e-3 * scale * torch.randn(w.shape, generator=g)
    return wq, wk, step(wq), step(wk)


def dense_delta2(wq, wk, wq2, wk2):
    return (wq2 - wq) @ wk.transpose(1, 2) + wq @ (wk2 - wk).transpose(1, 2)


def best_time(fn, repeats):
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="timing repeats for the compressed kernels")
    parser.add_argument("--dense-repeats", type=int, default=1, help="timing repeats for the dense baselines")
    parser.add_argument("--no-write", action="store_true", help="print only; do not update results/")
    args = parser.parse_args(argv)

    rows = []
    for d_model in args.sizes:
        w = make_case(d_model, args.heads, args.head_dim, rank_deficient=False)
        dense = dense_delta2(*w)
        # B023: best_time calls each lambda right here, so it sees this iteration's w and dense
        timings = {
            "gram": best_time(lambda: qk_increment_spectra(*w, terms=("delta2",), method="gram"),  # noqa: B023
                              args.repeats),
            "qr": best_time(lambda: qk_increment_spectra(*w, terms=("delta2",), method="qr"),  # noqa: B023
                            args.repeats),
            "dense_svd": best_time(lambda: torch.linalg.svdvals(dense), args.dense_repeats),  # noqa: B023
            "dense_gram_eigvalsh": best_time(
                lambda: torch.linalg.eigvalsh(dense.transpose(1, 2) @ dense), args.dense_repeats),  # noqa: B023
        }
        accuracy = {}
        for case, rank_deficient in (("random", False), ("rank2", True)):
            w32 = make_case(d_model, args.heads, args.head_dim, rank_deficient)
            w64 = [t.double() for t in w32]
            ref = matrix_spectrum(dense_delta2(*[t[:1] for t in w64]))[:, : 2 * args.head_dim]
            ref_entropy = spectral_entropy(ref)
            for method in ("gram", "qr"):
                for dtype_name, ws in (("f32", w32), ("f64", w64)):
                    sv = qk_increment_spectra(*ws, terms=("delta2",), method=method).delta2[:1]
                    accuracy[f"{case}/{method}/{dtype_name}"] = {
                        "sv_rel_err": ((sv - ref).abs().max() / ref[:, 0].max()).item(),
                        "entropy_abs_err": (spectral_entropy(sv) - ref_entropy).abs().max().item(),
                    }
        row = {"d_model": d_model, "seconds": timings, "accuracy": accuracy,
               "speedup_vs_dense_svd": {m: timings["dense_svd"] / timings[m] for m in ("gram", "qr")},
               "speedup_vs_dense_eigvalsh": {m: timings["dense_gram_eigvalsh"] / timings[m] for m in ("gram", "qr")}}
        rows.append(row)
        print(f"d_model={d_model}: gram {timings['gram']*1e3:.1f} ms, qr {timings['qr']*1e3:.1f} ms, "
              f"dense svd {timings['dense_svd']*1e3:.0f} ms, dense eigvalsh {timings['dense_gram_eigvalsh']*1e3:.0f} ms"
              f" | svd/gram {row['speedup_vs_dense_svd']['gram']:.0f}x,"
              f" svd/qr {row['speedup_vs_dense_svd']['qr']:.0f}x,"
              f" eigvalsh/gram {row['speedup_vs_dense_eigvalsh']['gram']:.0f}x", flush=True)
        for key, acc in accuracy.items():
            print(f"    {key:18s} max σ err / σ_max {acc['sv_rel_err']:.2e}   entropy err {acc['entropy_abs_err']:.2e}")

    lines = [f"Δ2 of {args.heads} heads, d_head {args.head_dim}, float32 inputs; best of {args.repeats} "
             f"(compressed) / {args.dense_repeats} (dense) runs, interleaved in one process.", "",
             "| d_model | gram ms | qr ms | dense SVD ms | dense Gram eigvalsh ms "
             "| SVD/gram | SVD/qr | eigvalsh/gram |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        t = r["seconds"]
        lines.append(f"| {r['d_model']} | {t['gram']*1e3:.1f} | {t['qr']*1e3:.1f} | {t['dense_svd']*1e3:.0f} | "
                     f"{t['dense_gram_eigvalsh']*1e3:.0f} | {r['speedup_vs_dense_svd']['gram']:.0f}× | "
                     f"{r['speedup_vs_dense_svd']['qr']:.0f}× | {r['speedup_vs_dense_eigvalsh']['gram']:.0f}× |")
    lines += ["", "Accuracy on head 0 vs a float64 dense SVD (σ error relative to σ_max; normalized entropy, "
              "absolute error). `rank2` = rank-2 increments (rank-deficient factors).", "",
              "| d_model | case/method/input dtype | σ err / σ_max | entropy err |", "|---|---|---|---|"]
    for r in rows:
        for key, acc in r["accuracy"].items():
            lines.append(f"| {r['d_model']} | {key} | {acc['sv_rel_err']:.1e} | {acc['entropy_abs_err']:.1e} |")
    if not args.no_write:
        path = write_results("bench_spectral", "\n".join(lines), {"rows": rows})
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
