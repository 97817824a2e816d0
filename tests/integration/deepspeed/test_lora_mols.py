"""MoLS on a LoRA model: a real Hugging Face Llama wrapped by peft, real text (bytes of the embedded corpus).

The param groups must hold exactly the trainable LoRA tensors (frozen base weights in no group), each under
its base module's class (q/k → qk, v/o → vo, gate/up/down → mlp, read here from the names independently of
the taxonomy), and after the window every group's lr must be base lr × clamp(sqrt(S_vo / S_class)) with S
recomputed here from the recorded two-batch norms by the closed form of the two-batch estimator.
"""
from __future__ import annotations

import math
import re

import pytest
import torch

from megatron_mech.core.mols import MoLSConfig
from megatron_mech.adapters.deepspeed.batches import global_batch
from megatron_mech.adapters.deepspeed.models import dense_llama
from megatron_mech.adapters.deepspeed.mols_backend import GROUP_KEY
from megatron_mech.trainers.data.embedded import load_corpus
from megatron_mech.studies.torch_mols import TorchMoLS
from optional_packages import requires

pytestmark = requires("peft")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _expected_class(name: str) -> str:
    module = re.search(r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.", name).group(1)
    return {"q_proj": "qk", "k_proj": "qk", "v_proj": "vo", "o_proj": "vo"}.get(module, "mlp")


def _lora_model(seed: int = 0):
    import peft

    model = dense_llama(vocab_size=256, hidden=32, layers=2, heads=4, kv_heads=2, ffn=64, seq_len=32, seed=seed)
    torch.manual_seed(seed + 1)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0, init_lora_weights=True)
    model = peft.get_peft_model(model, cfg)
    # peft starts B at zero (a zero update); give B a small value so A gets a gradient from step 0
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    return model


def _byte_tokens(n: int = 20000) -> torch.Tensor:
    text = " ".join(d.text for d in load_corpus(max_docs_per_source=3))
    return torch.tensor(list(text.encode("utf-8")[:n]), dtype=torch.long)


def _loss(model, batch):
    return model(input_ids=batch[:, :-1], labels=batch[:, :-1]).loss


def test_lora_param_groups_get_the_multiplier_of_their_class_from_the_snr():
    model = _lora_model()
    window, base_lr, micro, k = 3, 1e-3, 4, 4
    mols = TorchMoLS(model, MoLSConfig(window_steps=window, min_ramp_steps=0), lr=base_lr)
    trainable = {id(p): n for n, p in model.named_parameters() if p.requires_grad}
    frozen = {id(p) for n, p in model.named_parameters() if not p.requires_grad}
    assert trainable and frozen  # LoRA: adapters trainable, base frozen
    grouped = [(g[GROUP_KEY], p) for g in mols.groups for p in g["params"]]
    assert sorted(id(p) for _, p in grouped) == sorted(trainable)  # every adapter once, no frozen weight
    for cls, p in grouped:
        assert cls == _expected_class(trainable[id(p)]), trainable[id(p)]
    assert set(mols.classes) == {"qk", "vo", "mlp"}

    opt = torch.optim.AdamW(mols.groups, lr=base_lr)
    sched = mols.wrap_scheduler(opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0))
    tokens = _byte_tokens()
    records = []
    for it in range(window + 1):
        batch = global_batch(tokens, it, micro * k, seq_len=32, seed=7)
        mols.backward(it + 1, model, list(batch.split(micro)), _loss)  # MoLS counts steps from 1
        if it < window:
            records.append(dict(mols.last_observation))
        opt.step()
        sched.step()

    # independent: the two-batch closed form per step, then the window means
    b, big_b = float(micro), float(micro * k)
    snr = {}
    for cls in ("qk", "vo", "mlp"):
        g2 = [(big_b * r["big"][cls] - b * r["small"][cls]) / (big_b - b) for r in records]
        tr = [(r["small"][cls] - r["big"][cls]) / (1 / b - 1 / big_b) for r in records]
        snr[cls] = (sum(g2) / len(g2)) / (sum(tr) / len(tr))
        assert mols.controller.snr[cls]["snr"] == pytest.approx(snr[cls], rel=1e-9)
    assert all(s > 0 for s in snr.values()), snr
    # the check below is only informative if the classes' multipliers differ from 1 and from each other
    alphas = {c: min(max(math.sqrt(snr["vo"] / snr[c]), 0.5), 2.0) for c in snr}
    assert abs(alphas["qk"] - 1) > 0.05 and abs(alphas["mlp"] - 1) > 0.05 and abs(alphas["qk"] - alphas["mlp"]) > 0.05, alphas
    lrs = {}
    for g in opt.param_groups:
        lrs.setdefault(g[GROUP_KEY], set()).add(g["lr"])
    for cls in ("qk", "vo", "mlp"):
        alpha = min(max(math.sqrt(snr["vo"] / snr[cls]), 0.5), 2.0)
        assert len(lrs[cls]) == 1 and lrs[cls].pop() == pytest.approx(base_lr * alpha, rel=1e-9), (cls, alpha)
    # the frozen base weights never received a gradient
    assert all(p.grad is None for n, p in model.named_parameters() if not p.requires_grad)


def test_disabled_torch_mols_keeps_the_base_lr_and_the_same_groups():
    model = _lora_model()
    mols = TorchMoLS(model, MoLSConfig(window_steps=2, min_ramp_steps=0), lr=1e-3, enabled=False)
    opt = torch.optim.AdamW(mols.groups, lr=1e-3)
    sched = mols.wrap_scheduler(opt, None)
    tokens = _byte_tokens()
    for it in range(4):
        mols.backward(it + 1, model, list(global_batch(tokens, it, 8, seq_len=32).split(4)), _loss)
        opt.step()
        sched.step()
    assert {g["lr"] for g in opt.param_groups} == {1e-3} and mols.last_observation is None
