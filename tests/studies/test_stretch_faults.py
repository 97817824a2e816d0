"""The stretch faults of the diagnosis study: corrupted data (random tokens for some steps) and skipped optimizer steps
(non-finite gradients for some steps). Their steps, their validation, the data fault on a real HF model and a real
megatron-core run, the skip fault on a real HF model's gradients."""
from __future__ import annotations

import json
import math

import pytest
import torch

from megatron_mech.studies.fault_config import FaultConfig
from megatron_mech.studies.fault_schedule import FaultSchedule
from megatron_mech.studies.injectors import DataFault, FaultInjector, SkipFault
from dist_utils import run_torchrun
from optional_packages import requires


def test_a_stretch_lasts_its_steps_and_skips_an_even_fraction_of_them():
    every = FaultConfig(kind="skip", start=10, steps=4)
    assert [s for s in range(1, 30) if every.active(s)] == [10, 11, 12, 13]
    assert [s for s in range(1, 30) if every.skips(s)] == [10, 11, 12, 13]
    half = FaultConfig(kind="skip", start=10, steps=6, strength=0.5)
    skipped = [s for s in range(1, 30) if half.skips(s)]
    assert len(skipped) == math.floor(6 * 0.5) and all(10 <= s < 16 for s in skipped)
    assert all(b - a == 2 for a, b in zip(skipped, skipped[1:]))   # spread evenly, not bunched
    to_the_end = FaultConfig(kind="data", start=5)
    assert not to_the_end.active(4) and to_the_end.active(5) and to_the_end.active(10 ** 6)
    from_the_start = FaultConfig(kind="data", start=0, steps=3)   # start 0 = from step 1
    assert [s for s in range(1, 10) if from_the_start.active(s)] == [1, 2, 3]
    assert not FaultConfig(kind="data", start=5).skips(6)   # only the skip fault skips
    assert "for 4 steps" in every.describe()


@pytest.mark.parametrize("kwargs, field", [
    (dict(kind="data", strength=0.0), "strength"),
    (dict(kind="skip", strength=1.5), "strength"),
    (dict(kind="data", ramp=10), "ramp"),
    (dict(kind="lr", steps=10), "steps"),
    (dict(kind="skip", steps=-1), "steps"),
])
def test_bad_stretch_values_are_refused_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"FaultConfig.{field}"):
        FaultConfig(**kwargs)


def _llama():
    from megatron_mech.adapters.deepspeed.models import dense_llama

    return dense_llama(vocab_size=64, hidden=16, layers=1, heads=2, kv_heads=1, ffn=32, seq_len=9, seed=3)


@requires("transformers")
def test_data_fault_replaces_a_fraction_of_the_sequences_during_its_stretch_in_training_only():
    model, schedule = _llama(), FaultSchedule()
    fault = DataFault(FaultConfig(kind="data", start=3, steps=2, strength=0.5), schedule, model)
    seen = []
    model.register_forward_pre_hook(lambda m, a, kw: seen.append((kw["input_ids"].clone(), kw["labels"].clone())),
                                    with_kwargs=True)
    tokens = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(0))

    def forward(step, training=True):
        schedule.step = step
        model.train(training)
        model(input_ids=tokens, labels=tokens)
        return seen[-1]

    assert all(torch.equal(x, tokens) for x in forward(2))   # before the stretch
    inputs, labels = forward(3)
    assert torch.equal(inputs, labels) and torch.equal(inputs[2:], tokens[2:])   # half of the 4 sequences
    assert not torch.equal(inputs[:2], tokens[:2]) and int(inputs.max()) < 64
    again, _ = forward(3)
    assert not torch.equal(again[:2], inputs[:2])   # the next micro-batch of the step gets other tokens
    assert all(torch.equal(x, tokens) for x in forward(4, training=False))   # validation sees the true data
    assert all(torch.equal(x, tokens) for x in forward(5))   # after the stretch
    fault.close()
    assert all(torch.equal(x, tokens) for x in forward(3))


@requires("transformers")
def test_skip_fault_makes_every_gradient_infinite_on_its_steps_only_the_loss_finite():
    model, schedule = _llama(), FaultSchedule()
    fault = SkipFault(FaultConfig(kind="skip", start=2, steps=1), schedule, model)
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    for step in (1, 2, 3):
        schedule.step = step
        model.zero_grad()
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        assert math.isfinite(loss.item()) and grads
        assert all(bool(torch.isinf(g).all()) for g in grads) == (step == 2)
        assert all(bool(torch.isfinite(g).all()) for g in grads) == (step != 2)
    fault.close()


@requires("transformers")
def test_the_injector_installs_the_model_faults_and_removes_them_on_close():
    model = _llama()
    injector = FaultInjector(FaultConfig(kind="data", start=1, steps=1))
    injector.prepare_model(model)
    assert [type(f) for f in injector.model_faults] == [DataFault]
    injector.close()
    assert injector.model_faults == [] and not model._forward_pre_hooks


TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "128",
        "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr-warmup-iters", "2",
        "--log-interval", "5", "--eval-iters", "1", "--mech-interval", "5", "--seed", "11", "--train-iters", "16"]


@pytest.mark.slow
@requires("megatron.core")
def test_data_fault_in_a_megatron_core_run_raises_the_loss_for_its_stretch_only(tmp_path):
    """A real run of our entry point: the same seed with and without 4 steps of random tokens from step 9. Before
    them the runs are the same run; on them the loss is that of random tokens (about ln V, far above the run's);
    the validation forward at the end sees the true data."""
    def run(name, *fault):
        run_torchrun("-m", "megatron_mech.studies.pretrain_gpt_fault", *TINY, "--save", str(tmp_path / name), *fault,
                     nproc=1, timeout=300)
        return json.loads((tmp_path / name / "summary.json").read_text())["losses"]

    clean = run("clean")
    corrupted = run("data", "--mech-fault", "data", "--mech-fault-start", "9", "--mech-fault-steps", "4")
    assert corrupted[:8] == clean[:8]
    vocab = 8192
    assert all(loss > max(clean[8:12]) + 0.3 and abs(loss - math.log(vocab)) < 1.0 for loss in corrupted[8:12])
    assert all(loss < math.log(vocab) - 0.3 for loss in corrupted[12:])
