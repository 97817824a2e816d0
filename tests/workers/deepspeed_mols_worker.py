"""torchrun worker (one gloo rank): MoLS on real DeepSpeed engines with HF models, checked against references.

One rank with gradient accumulation 2: the small batch is a micro-batch, the big batch the step's two. Every
model is a tiny HF model built from its config (no download). Scenarios (each reports its own errors):

* ``fused_phi3`` / ``fused_gpt2`` / ``fused_phi3_zero3``: Phi-3 ``qkv_proj`` (GQA; rule ``rows``, at ZeRO 0 and 3)
  and GPT-2 ``c_attn`` (``Conv1D``, ``[in, out]``; rule ``qk``).
  The per-class squared gradient norms MoLS measures at the first window step equal plain-autograd references
  on an untouched copy of the model, with the fused gradient's Q/K and V parts sliced as the HF forward slices
  the fused projection (independent of the taxonomy's splitter); after the ramp the fused parameter's group lr is
  base × the rule's multiplier written out here (``rows``: α_qk^((H+G)/(H+2G)) · α_vo^(G/(H+2G)); ``qk``: α_qk),
  with α_qk ≠ 1, and every other group's lr is base × its class's α.
* ``hf_experts``: Qwen2-MoE (HF experts) under a WarmupLR schedule, writing ``mech.jsonl``. The lrs the optimizer
  holds right before each ``engine.step()`` (what the update runs at) equal the record's ``lr`` × its
  ``mols/mult/{class}`` for every group at every step (window steps included); after the ramp the experts
  group's lr is base · ``mols/alpha/experts`` with α ≠ 1; ``mols/status`` is ``window`` then ``estimated``.
* ``ds_moe``: Llama with DeepSpeed-MoE layers (``ep_size=1``): the DeepSpeed expert groups stay at the base lr
  at every step (and are recorded at 1.0) while the measured classes are scaled.
* ``no_signal``: the two micro-batches of every window step have opposite gradients (same batch, negated loss),
  so every class's ‖G‖² estimate is negative: the records say ``mols/status`` = ``not_estimated`` with a reason
  naming the base class and the window option, a logging warning says so once, and every lr stays at base.

Rank 0 prints ``DEEPSPEED_MOLS_WORKER PASS`` and ``@@RESULT {json}`` (per scenario: its errors and values).
"""
from __future__ import annotations

import argparse
import copy
import json
import logging
import math
import os
import warnings

import torch
import torch.distributed as dist

SEQ, MICRO, GAS, VOCAB = 16, 2, 2, 256
BASE_LR = 3e-3


def corpus_tokens() -> torch.Tensor:
    from megatron_mech.trainers.data.embedded import load_corpus

    text = "\n".join(d.text for d in load_corpus(max_docs_per_source=2))
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.int64)


def micro_batch(tokens, step: int, m: int) -> torch.Tensor:
    from megatron_mech.adapters.deepspeed.batches import rank_batch

    return rank_batch(tokens, GAS * step + m, MICRO, 0, 1, SEQ)


def tiny(kind: str) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=SEQ + 1, tie_word_embeddings=False, use_cache=False,
                  bos_token_id=1, eos_token_id=1, pad_token_id=0)
    if kind == "phi3":
        config = transformers.Phi3Config(intermediate_size=48, **common)
        model = transformers.Phi3ForCausalLM
    elif kind == "gpt2":
        # no dropout: the engine's model and the reference copy must see the same forward
        config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=SEQ + 1,
                                         bos_token_id=1, eos_token_id=1, use_cache=False, resid_pdrop=0.0,
                                         embd_pdrop=0.0, attn_pdrop=0.0)
        model = transformers.GPT2LMHeadModel
    elif kind == "qwen2moe":
        config = transformers.Qwen2MoeConfig(intermediate_size=48, moe_intermediate_size=16,
                                             shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                                             decoder_sparse_step=1, **common)
        model = transformers.Qwen2MoeForCausalLM
    else:
        raise ValueError(kind)
    config._attn_implementation = "eager"
    return model(config)


def build(model, mols: dict, out: str | None = None, scheduler: dict | None = None, moe: bool = False, stage: int = 0):
    import deepspeed
    from megatron_mech.adapters.deepspeed.engine import DeepSpeedMech
    from megatron_mech.adapters.deepspeed.mols_backend import param_groups

    groups = param_groups(model, weight_decay=0.01)
    if moe:
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

        groups = split_params_into_different_moe_groups_for_optimizer(groups)
    mech = {"monitors": {"families": [], "interval": 1}, "mols": dict({"enabled": True, "window": 2, "min_ramp": 1,
                                                                         "clamp": [0.1, 10.0]}, **mols)}
    if out is not None:
        mech["output"] = {"dir": out}
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
              "zero_optimization": {"stage": stage}, "steps_per_print": 10 ** 9, "mech": mech}
    if scheduler is not None:
        config["scheduler"] = scheduler
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(groups, lr=BASE_LR),
                                           config=config)
    return engine, DeepSpeedMech.from_engine(engine, train_steps=6)


def train_step(engine, mech, tokens, step: int, negate_second: bool = False, aux: bool = False) -> list[float]:
    """One optimizer step of GAS micro-batches; returns the group lrs the update ran at (read right before
    ``engine.step()`` of the last micro-batch, where DeepSpeed steps the optimizer and then the scheduler)."""
    from megatron_mech.adapters.deepspeed.models import moe_aux_loss

    mech.before_step()
    applied = None
    for m in range(GAS):
        batch = micro_batch(tokens, step, 0 if negate_second else m)
        loss = engine(input_ids=batch, labels=batch).loss
        if aux:
            loss = loss + 0.01 * moe_aux_loss(engine.module)
        engine.backward(-loss if (negate_second and m == 1) else loss)
        mech.after_backward()
        if m == GAS - 1:
            applied = [float(g["lr"]) for g in engine.optimizer.param_groups]
        engine.step()
    mech.after_step(loss)
    return applied


def read_records(out: str) -> dict:
    from megatron_mech.records.sinks import read_jsonl

    return {r["step"]: r for r in read_jsonl(os.path.join(out, "mech.jsonl"))}


# ------------------------------------------------------------------------------------------------ fused QKV
def reference_rows(kind: str, name: str, grad: torch.Tensor, h: int, g: int, dh: int) -> dict:
    """Q, K, V parts of a fused gradient as the HF forward slices the fused projection's output."""
    sizes = [h * dh, g * dh, g * dh]
    if kind == "gpt2" and grad.dim() == 2:  # Conv1D: x @ W, W [in, out]: output features are columns
        parts = grad.split(sizes, dim=1)
    else:
        parts = grad.split(sizes, dim=0)
    return dict(zip("qkv", parts))


def scenario_fused(kind: str, rule: str, errors: list, stage: int = 0) -> dict:
    from megatron_mech.core.taxonomy import classify_parameters

    tokens = corpus_tokens()
    model = tiny(kind)
    reference = copy.deepcopy(model)
    engine, mech = build(model, {"fused_qkv_rule": rule}, stage=stage)
    ctl = mech.mols.controller
    observed = []
    real_observe = ctl.observe
    ctl.observe = lambda step, small, big, bs, bb: (observed.append((step, dict(small), dict(big))),
                                                     real_observe(step, small, big, bs, bb))[1]
    for step in range(4):
        train_step(engine, mech, tokens, step)
    h, g = 4, (4 if kind == "gpt2" else 2)
    dh = 8
    # small/big squared norms of the first window step against autograd on the untouched copy
    tax = classify_parameters(reference)
    params = dict(reference.named_parameters())
    grads = []
    for m in range(GAS):
        batch = micro_batch(tokens, 0, m)
        reference.zero_grad()
        reference(input_ids=batch, labels=batch).loss.backward()
        grads.append({n: params[n].grad.detach().double().clone() for n in tax})
    want_small, want_big = {}, {}

    def add(into, key, value):
        into[key] = into.get(key, 0.0) + value

    for name, cls in tax.items():
        mean = sum(gr[name] for gr in grads) / GAS
        if name in tax.fused_qkv:
            for block, part in reference_rows(kind, name, mean, h, g, dh).items():
                add(want_big, "vo" if block == "v" else "qk", float(part.pow(2).sum()))
                add(want_big, f"qkv_{block}", float(part.pow(2).sum()))
            for gr in grads:
                for block, part in reference_rows(kind, name, gr[name], h, g, dh).items():
                    add(want_small, "vo" if block == "v" else "qk", float(part.pow(2).sum()) / GAS)
                    add(want_small, f"qkv_{block}", float(part.pow(2).sum()) / GAS)
        else:
            add(want_big, cls, float(mean.pow(2).sum()))
            for gr in grads:
                add(want_small, cls, float(gr[name].pow(2).sum()) / GAS)
    if not observed or observed[0][0] != 1:
        errors.append(f"{kind}: no observation of step 1: {[o[0] for o in observed]}")
        return {}
    _, small, big = observed[0]
    for what, got, want in (("small", small, want_small), ("big", big, want_big)):
        if set(got) != set(want):
            errors.append(f"{kind} {what}-batch keys {sorted(got)} != reference {sorted(want)}")
        for key in want:
            # float32 model vs the same float32 reference model, summed in float64: 1e-5 covers summation order
            if key not in got or not math.isclose(got[key], want[key], rel_tol=1e-5):
                errors.append(f"{kind} {what}-batch |g|^2 of {key}: MoLS {got.get(key)!r} != reference {want[key]!r}")
    # after the ramp (window steps 1-2, ramp end 3): the lrs now set are those of step 5
    a = ctl.alphas
    if abs(a.get("qk", 1.0) - 1.0) < 1e-3:
        errors.append(f"{kind}: alpha_qk {a.get('qk')} is 1: Q/K are not scaled")
    w_qk = (h + g) / (h + 2 * g)
    want_qk = a["qk"] ** w_qk * a["vo"] ** (1 - w_qk) if rule == "rows" else a[rule]
    for group in engine.optimizer.param_groups:
        cls = group["mols_class"]
        want = BASE_LR * (want_qk if cls == "qk" else a.get(cls, 1.0) if cls not in ("norm", "other") else 1.0)
        if not math.isclose(group["lr"], want, rel_tol=1e-12):
            errors.append(f"{kind} rule {rule}: group {cls} lr {group['lr']!r} != base x multiplier {want!r} "
                          f"(alphas {a})")
    mech.close()
    return {"alphas": dict(a), "qk_multiplier": want_qk}


# ------------------------------------------------------------------------------------------------ experts
WARMUP = {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": BASE_LR, "warmup_num_steps": 8,
                                         "warmup_type": "linear"}}


def check_records(label: str, records: dict, applied: dict, errors: list) -> None:
    """Every group's lr at its update = the record's lr × the record's multiplier of the group's class."""
    for step, lrs in applied.items():
        rec = records.get(step)
        if rec is None:
            errors.append(f"{label}: no record of step {step}")
            continue
        for cls, lr in lrs:
            mult = rec["mols"].get(f"mols/mult/{cls}")
            if mult is None or not math.isclose(rec["lr"] * mult, lr, rel_tol=1e-12):
                errors.append(f"{label} step {step}: group {cls} ran at lr {lr!r}, the record says lr {rec['lr']!r} "
                              f"x mols/mult/{cls} {mult!r}")


def scenario_hf_experts(out: str, errors: list) -> dict:
    tokens = corpus_tokens()
    engine, mech = build(tiny("qwen2moe"), {}, out=out, scheduler=WARMUP)
    applied = {}
    for step in range(4):
        lrs = train_step(engine, mech, tokens, step)
        applied[step + 1] = list(zip([g["mols_class"] for g in engine.optimizer.param_groups], lrs))
    mech.close()
    records = read_records(out)
    check_records("qwen2-moe", records, applied, errors)
    statuses = [records[s]["mols"].get("mols/status") for s in sorted(records)]
    if statuses != ["window", "estimated", "estimated", "estimated"]:
        errors.append(f"qwen2-moe mols/status per step {statuses} != window, then estimated")
    last = records[4]  # the first step after the ramp's end (3): multipliers at α
    alpha = last["mols"].get("mols/alpha/experts")
    if alpha is None or abs(alpha - 1.0) < 1e-3:
        errors.append(f"qwen2-moe: alpha/experts {alpha!r} is missing or 1")
    expert_lrs = [lr for cls, lr in applied[4] if cls == "experts"]
    if not expert_lrs or not all(math.isclose(lr, last["lr"] * (alpha or 0.0), rel_tol=1e-12) for lr in expert_lrs):
        errors.append(f"qwen2-moe step 4: experts group lr {expert_lrs} != base {last['lr']} x alpha/experts {alpha}")
    return {"alpha_experts": alpha, "statuses": statuses}


def scenario_ds_moe(out: str, errors: list) -> dict:
    from megatron_mech.adapters.deepspeed.models import deepspeed_moe_llama

    tokens = corpus_tokens()
    model = deepspeed_moe_llama(vocab_size=VOCAB, seq_len=SEQ + 1, num_experts=2, ep_size=1, k=1)
    engine, mech = build(model, {}, out=out, scheduler=WARMUP, moe=True)
    applied = {}
    for step in range(4):
        lrs = train_step(engine, mech, tokens, step, aux=True)
        applied[step + 1] = list(zip([(g["mols_class"], bool(g.get("moe"))) for g in engine.optimizer.param_groups],
                                     lrs))
    mech.close()
    records = read_records(out)
    check_records("deepspeed-moe", records, {s: [(c, lr) for (c, _), lr in v] for s, v in applied.items()}, errors)
    moe_groups = [(step, lr) for step, v in applied.items() for (cls, moe), lr in v if moe]
    if not moe_groups:
        errors.append("deepspeed-moe: no optimizer group is marked moe")
    for step, lr in moe_groups:
        if not math.isclose(lr, records[step]["lr"], rel_tol=1e-12):
            errors.append(f"deepspeed-moe step {step}: an expert group ran at {lr!r}, not the base lr "
                          f"{records[step]['lr']!r}")
    scaled = [cls for (cls, moe), lr in applied[4] if not moe and abs(lr / records[4]["lr"] - 1.0) > 1e-3]
    if not scaled:
        errors.append("deepspeed-moe: no dense class is scaled after the ramp")
    return {"scaled": sorted(set(scaled))}


# ------------------------------------------------------------------------------------------------ no signal
def scenario_no_signal(out: str, errors: list) -> dict:
    from megatron_mech.core.mols import MoLSWarning
    from megatron_mech.adapters.deepspeed.models import dense_llama

    tokens = corpus_tokens()
    warned = []

    class Collect(logging.Handler):
        def emit(self, record):
            if record.levelno >= logging.WARNING:
                warned.append(record.getMessage())

    handler = Collect()
    logging.getLogger("megatron_mech").addHandler(handler)
    engine, mech = build(dense_llama(vocab_size=VOCAB, seq_len=SEQ + 1), {"window": 1}, out=out)
    applied = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MoLSWarning)
        for step in range(3):
            lrs = train_step(engine, mech, tokens, step, negate_second=(step == 0))
            applied[step + 1] = lrs
    mech.close()
    logging.getLogger("megatron_mech").removeHandler(handler)
    records = read_records(out)
    for step, rec in records.items():
        status, reason = rec["mols"].get("mols/status"), rec["mols"].get("mols/status_reason") or ""
        if status != "not_estimated" or "'vo'" not in reason or "negative" not in reason \
                or "mech.mols.window" not in reason:
            errors.append(f"no-signal step {step}: mols/status {status!r}, reason {reason!r}")
    for step, lrs in applied.items():
        if any(not math.isclose(lr, BASE_LR, rel_tol=1e-12) for lr in lrs):
            errors.append(f"no-signal step {step}: lrs {lrs} != base {BASE_LR}")
    loud = [w for w in warned if "MoLS" in w and "'vo'" in w and "window" in w]
    if len(loud) != 1:
        errors.append(f"expected one logging warning naming the base class and the window, got {warned}")
    return {"warnings": warned[:2]}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--scenarios", default="fused_phi3,fused_gpt2,fused_phi3_zero3,hf_experts,ds_moe,no_signal")
    parser.add_argument("--tmp", required=True)
    args = parser.parse_args()
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    import deepspeed
    from megatron_mech.adapters.deepspeed.cpu import skip_shm_comm_build

    skip_shm_comm_build()
    deepspeed.init_distributed(dist_backend="gloo")
    result = {}
    for name in args.scenarios.split(","):
        errors: list[str] = []
        out = os.path.join(args.tmp, name)
        if name == "fused_phi3":
            values = scenario_fused("phi3", "rows", errors)
        elif name == "fused_gpt2":
            values = scenario_fused("gpt2", "qk", errors)
        elif name == "fused_phi3_zero3":  # partitioned parameters: the hooks and safe_get_full_grad see full grads
            values = scenario_fused("phi3", "rows", errors, stage=3)
        else:
            values = globals()[f"scenario_{name}"](out, errors)
        result[name] = {"errors": errors, "values": values}
    print("@@RESULT " + json.dumps(result, default=str), flush=True)
    print("DEEPSPEED_MOLS_WORKER PASS", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from verdict import exit_without_destructors  # tests/workers/, the script's directory

    exit_without_destructors(main())
