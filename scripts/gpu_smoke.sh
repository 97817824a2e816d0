#!/usr/bin/env bash
# Single-GPU smoke test (not part of CI, which has no GPU): the monitors' math on CUDA equals CPU, and the
# training entry point trains a small MoE GPT on one GPU over nccl with the monitors on. The CPU shims stay off
# on a GPU machine; only the megatron-core fixes of megatron_mech.adapters.megatron_core.fixes apply (as on every machine).
# Usage: bash scripts/gpu_smoke.sh OUT_DIR
set -euo pipefail
out=${1:-runs/gpu_smoke}
mkdir -p "$out"
export MEGATRON_MECH_DATA=${MEGATRON_MECH_DATA:-/tmp/megatron_mech_data}
python3 - <<'PY'
import torch
from megatron_mech.core.spectral import qk_increment_spectra, spectral_entropy
from megatron_mech.core.router_statistics import RoutingStats
from megatron_mech.adapters.megatron_core import cpu_shims as megatron_cpu
assert torch.cuda.is_available(), "no CUDA device"
assert megatron_cpu.apply_cpu_shims() == [], "CPU shims must not patch anything on a GPU machine"
g = torch.Generator().manual_seed(0)
w = [torch.randn(16, 1024, 128, generator=g) for _ in range(2)] + [torch.randn(4, 1024, 128, generator=g) for _ in range(2)]
wq, wq2, wk, wk2 = w[0], w[0] + 1e-3 * w[1], w[2], w[2] + 1e-3 * w[3]
# float64 Grams and cores: CUDA equals CPU to rounding; the float32 default: to float32's stated accuracy
for gram_dtype, sv_tol, ent_tol in ((torch.float64, 1e-9, 1e-9), (None, 1e-3, 1e-5)):
    cpu = qk_increment_spectra(wq, wk, wq2, wk2, gram_dtype=gram_dtype)
    gpu = qk_increment_spectra(*(t.cuda() for t in (wq, wk, wq2, wk2)), gram_dtype=gram_dtype)
    for name, sv in cpu.items():
        err = (getattr(gpu, name).cpu() - sv).abs().max().item() / sv.max().item()
        ent = (spectral_entropy(getattr(gpu, name).cpu()) - spectral_entropy(sv)).abs().max().item()
        print(f"QK {name} ({gram_dtype or 'float32 default'}): CUDA vs CPU max σ error / σ_max {err:.1e}, "
              f"entropy {ent:.1e}")
        assert err < sv_tol and ent < ent_tol
# the per-head eigenproblems of 4 layers × 8 heads (d_head 32, the smoke model's): one call per head vs all
import time
from megatron_mech.core.spectral import qk_increment_cores, spectra_from_qk_cores
cores = [qk_increment_cores(*(torch.randn(8, 256, 32, generator=g).cuda() * s for s in (1, 1, 1, 1))) for _ in range(4)]
for mode in ("head", "item", "all"):
    spectra_from_qk_cores(cores, batch=mode); torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        spectra_from_qk_cores(cores, batch=mode)
    torch.cuda.synchronize()
    print(f"QK cores, 4 layers x 8 heads x 3 terms on CUDA, batch={mode}: {(time.perf_counter() - t0) / 5 * 1e3:.1f} ms")
logits = torch.randn(4096, 8, generator=g) * 3
a, b = RoutingStats(8), RoutingStats(8)
a.update(logits, 2); b.update(logits.cuda(), 2)
# float32 entropies: CUDA and CPU kernels round differently in the last bits
assert all(abs(a.summary()[k] - b.summary()[k]) <= 1e-6 * max(1.0, abs(a.summary()[k])) for k in a.summary())
print("RoutingStats CUDA == CPU")
PY
python3 -m torch.distributed.run --standalone --nproc_per_node=1 -m megatron_mech.trainers.megatron_core.pretrain_gpt \
    --num-layers 4 --hidden-size 256 --num-attention-heads 8 --num-query-groups 4 --num-experts 4 \
    --moe-router-topk 2 --seq-length 256 --micro-batch-size 8 --global-batch-size 32 --train-iters 200 \
    --lr 1e-3 --lr-warmup-iters 20 --log-interval 20 --mech-interval 10 --save "$out/run" \
    --tensorboard-dir "$out/run/tb"
python3 -m megatron_mech.cli report "$out/run"
# the same run evaluating on the host (snapshots and arithmetic in CPU memory), to compare the monitor cost
python3 -m torch.distributed.run --standalone --nproc_per_node=1 -m megatron_mech.trainers.megatron_core.pretrain_gpt \
    --num-layers 4 --hidden-size 256 --num-attention-heads 8 --num-query-groups 4 --num-experts 4 \
    --moe-router-topk 2 --seq-length 256 --micro-batch-size 8 --global-batch-size 32 --train-iters 200 \
    --lr 1e-3 --lr-warmup-iters 20 --log-interval 20 --mech-interval 10 --mech-eval-device host \
    --save "$out/run_host" --tensorboard-dir "$out/run_host/tb"
python3 -m megatron_mech.cli report "$out/run_host"
