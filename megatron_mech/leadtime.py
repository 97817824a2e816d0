"""Shared by the lead-time benchmark and the demo: the small fault-study model, the fault flags, the one
definition of loss divergence, first-alert bookkeeping and the fault plot.

Divergence (used everywhere): the first step from which the 20-step moving average of the loss stays more
than ``margin`` nats above the clean run of the same seed until the end of the run, or the first non-finite
loss.
"""
from __future__ import annotations

import math

__all__ = ["FAULT_FLAGS", "LEAD_MODEL", "divergence_step", "first_alert", "moving_average", "peak_score",
           "plot_fault"]

# The small MoE GPT of the fault studies: 4 layers, hidden 64, 4 heads, 4 experts top-2, EP=2 on 2 processes.
LEAD_MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "128",
              "--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "2",
              "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "16", "--lr", "2e-3",
              "--min-lr", "2e-4", "--lr-warmup-iters", "50", "--log-interval", "100", "--mech-interval", "5",
              "--eval-iters", "1"]
FAULT_FLAGS = {
    "attention": ["--mech-fault", "attention", "--mech-fault-strength", "0.1", "--mech-fault-layers", "1"],
    "lr": ["--mech-fault", "lr", "--mech-fault-strength", "4"],
    "small_batch": ["--mech-fault", "small_batch", "--mech-fault-strength", "4"],
    "combined": ["--mech-fault", "combined", "--mech-fault-strength", "0.1", "--mech-fault-layers", "1",
                 "--mech-fault-lr-factor", "4"],
}


def moving_average(values, window=20):
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def divergence_step(losses, clean_losses, margin):
    """First 1-based step from which the moving-average loss stays > clean + margin to the end (or NaN)."""
    for i, v in enumerate(losses):
        if not math.isfinite(v):
            return i + 1
    ma, ma_clean = moving_average(losses), moving_average(clean_losses)
    n = min(len(ma), len(ma_clean))
    above = [ma[i] > ma_clean[i] + margin for i in range(n)]
    for i in range(n):
        if all(above[i:]):
            return i + 1
    return None


def first_alert(alerts, family=None, pattern=None, after=0):
    hits = [a.step for a in alerts if a.step > after and (family is None or a.family == family)
            and (pattern is None or pattern in a.metric)]
    return min(hits) if hits else None


def peak_score(alerts, family, after=0):
    scores = [a.score for a in alerts if a.family == family and a.step > after]
    return max(scores) if scores else None


def plot_fault(path, name, clean, faulty, start, divergence, firsts):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    steps = range(1, len(faulty["losses"]) + 1)
    axes[0].plot(range(1, len(clean["losses"]) + 1), moving_average(clean["losses"]), color="grey", label="clean")
    axes[0].plot(steps, moving_average(faulty["losses"]), color="C3", label=f"{name} fault")
    axes[0].set_ylabel("loss (20-step MA)")

    def series(run, key, reduce):
        xs, ys = [], []
        for r in run["records"]:
            vals = [v for k, v in r["metrics"].items() if key(k) and isinstance(v, float) and math.isfinite(v)]
            if vals:
                xs.append(r["step"])
                ys.append(reduce(vals))
        return xs, ys

    for run, color, label in ((clean, "grey", "clean"), (faulty, "C3", name)):
        axes[1].plot(*series(run, lambda k: k.startswith("attn/layer1/head") and k.endswith("delta2_entropy"), min),
                     color=color, label=label)
        axes[2].plot(*series(run, lambda k: k.startswith("router/") and k.endswith("/entropy_mean"), min),
                     color=color, label=label)
    axes[1].set_ylabel("layer 1 Δ2 entropy\n(min over heads)")
    axes[2].set_ylabel("routing entropy\n(min over layers, nats)")
    axes[2].set_xlabel("step")
    for ax in axes:
        if start:
            ax.axvline(start, color="black", lw=1, ls=":", label="fault on")
        if divergence:
            ax.axvline(divergence, color="C3", lw=1.5, ls="--", label="loss diverged")
        for fam, color in (("attention", "C0"), ("router", "C1"), ("symptom", "C2")):
            if firsts.get(fam):
                ax.axvline(firsts[fam], color=color, lw=1.2, label=f"first {fam} alert")
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8)
    fig.suptitle(f"{name} fault (seed {faulty['seed']}): monitors vs loss")
    fig.tight_layout(rect=(0, 0.06, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)
