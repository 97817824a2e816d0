"""Loading a checkpoint never runs code from it (our per-rank files are read with ``weights_only=True``), and a
checkpoint that does not fit the run (MoLS on/off) is refused by name before anything is loaded.

The reference is the payload itself: a crafted ``rank0000.pt`` whose pickle would create a marker file (through
``os.system``, as a real attack would) must be refused with an error naming the file, and the marker must not
exist afterwards. A genuine file of the same shape (tensors and plain data) still loads.
"""
from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch

from megatron_mech.trainers.megatron_core.checkpoint import TRACKER, load_checkpoint, read_checkpoint_file


class _Payload:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch '{self.marker}'",)


def _write_run(tmp_path, state) -> tuple:
    run = tmp_path / "run"
    (run / "iter_0000005").mkdir(parents=True)
    torch.save(state, run / "iter_0000005" / "rank0000.pt")
    (run / TRACKER).write_text("5")
    return run, run / "iter_0000005" / "rank0000.pt"


def test_malicious_pickle_in_a_checkpoint_does_not_run(tmp_path):
    marker = tmp_path / "pwned"
    run, path = _write_run(tmp_path, {"iteration": 5, "layout": {}, "model": _Payload(marker)})
    with pytest.raises(RuntimeError, match="rank0000.pt") as info:
        load_checkpoint(run, model=None, optimizer=None, scheduler=None, layout={})
    assert "weights_only" in str(info.value)
    assert not marker.exists()  # the payload never ran
    assert path.exists()  # and the file is left as it was, for inspection


def test_genuine_state_loads_with_weights_only(tmp_path):
    state = {"iteration": 5, "layout": {"world": 1, "tp": 1}, "model": {"w": torch.arange(3.0)},
             "rng": {"torch": torch.get_rng_state(), "cuda": None}, "mech": {"version": 1, "values": [1.0, None]},
             "mols": None}
    _, path = _write_run(tmp_path, state)
    loaded = read_checkpoint_file(path)
    assert torch.equal(loaded["model"]["w"], state["model"]["w"]) and loaded["mech"] == state["mech"]


def test_mols_on_off_mismatch_is_refused_by_name(tmp_path):
    """Saved with --mech-mols and loaded without (and the reverse): refused before the optimizer is touched."""
    class HookWithMoLS:  # what load_checkpoint reads of the hook: whether MoLS is on
        mols = object()

    for saved, current in ((True, None), (False, HookWithMoLS())):
        run, _ = _write_run(tmp_path / str(saved), {"iteration": 5, "layout": {}, "model": {}, "mols_enabled": saved,
                                                     "mech": {"mols": {"version": 1} if saved else None}})
        with pytest.raises(ValueError, match="--mech-mols") as info:
            load_checkpoint(run, model=None, optimizer=None, scheduler=None, layout={}, hook=current)
        assert ("Remove" if not saved else "Add") in str(info.value)


# ------------------------------------------------------------------------- checkpoints that do not fit the run
def _model_and_optimizer(out_features=3):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, out_features)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    return model, optimizer, scheduler


def _hook():
    """A real MechHook with the attention monitor on a one-layer view (what load_checkpoint restores into)."""
    from megatron_mech.config import MechConfig, MonitorConfig
    from megatron_mech.hook import MechHook
    from megatron_mech.model_view import ModelView
    from megatron_mech.monitors.attention import AttentionLayer
    from megatron_mech.records.sinks import CallbackSink

    hook = MechHook(MechConfig(monitors=MonitorConfig(families=("attention",), interval=2, qk_terms=("delta2",))),
                    sinks=CallbackSink(lambda record: None))
    view = ModelView(attention_layers=[AttentionLayer(0, torch.randn(48, 16), 2, 2, 8)])
    hook.attach_optimizer(None)
    return hook, view


def _checkpoint(tmp_path, mech=None, model_state=None):
    from megatron_mech.trainers.megatron_core.checkpoint import _rng_state

    model, optimizer, scheduler = _model_and_optimizer()
    state = {"iteration": 5, "layout": {}, "model": model_state or model.state_dict(),
             "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "rng": _rng_state(),
             "mech": mech, "mols_enabled": False}
    return _write_run(tmp_path, state)


def test_tracker_without_an_iteration_number_is_named(tmp_path):
    run, _ = _checkpoint(tmp_path)
    (run / TRACKER).write_text("abc\n")
    with pytest.raises(ValueError) as info:
        load_checkpoint(run, *_model_and_optimizer(), layout={})
    assert str(run / TRACKER) in str(info.value) and "'abc', not an iteration number" in str(info.value)
    (run / TRACKER).write_text("9")  # a number, but no such iteration
    with pytest.raises(ValueError, match="names iteration 9, but .*iter_0000009 does not exist"):
        load_checkpoint(run, *_model_and_optimizer(), layout={})


def test_checkpoint_of_another_model_shape_is_named(tmp_path):
    """The reference is the two models' own shapes: the file holds a 4→5 linear, the run builds 4→3."""
    other, _, _ = _model_and_optimizer(out_features=5)
    run, path = _checkpoint(tmp_path, model_state=other.state_dict())
    with pytest.raises(ValueError) as info:
        load_checkpoint(run, *_model_and_optimizer(out_features=3), layout={})
    message = str(info.value)
    assert str(path) in message and "weight is (5, 4) there, (3, 4) here" in message and "--hidden-size" in message


def test_foreign_hook_state_version_is_named(tmp_path):
    hook, _ = _hook()
    run, path = _checkpoint(tmp_path, mech={**hook.state_dict(), "version": 99})
    with pytest.raises(ValueError) as info:
        load_checkpoint(run, *_model_and_optimizer(), layout={}, hook=hook)
    assert str(path) in str(info.value) and "version 99" in str(info.value)


def test_damaged_detector_state_is_named(tmp_path):
    """A saved hook state whose detector registry lost an entry: the error names the file and the entry, when the
    monitors that read it are set up (after the checkpoint's other parts are loaded)."""
    saved, _ = _hook()
    mech = saved.state_dict()
    del mech["detectors"]["unmonitored"]
    run, path = _checkpoint(tmp_path, mech=mech)
    hook, view = _hook()
    assert load_checkpoint(run, *_model_and_optimizer(), layout={}, hook=hook) == 5
    with pytest.raises(ValueError) as info:
        hook.setup(view, None, start_step=5)
    assert str(path) in str(info.value) and "missing entry 'unmonitored'" in str(info.value)
    intact, view = _hook()  # the same state, undamaged, loads
    load_checkpoint(_checkpoint(tmp_path / "intact", mech=saved.state_dict())[0], *_model_and_optimizer(),
                    layout={}, hook=intact)
    intact.setup(view, None, start_step=5)


def test_a_state_loaded_without_a_source_names_the_state_not_none():
    """An adapter that knows no file passes ``source=None`` (the DeepSpeed wrapper's ``load_state_dict``): the
    errors name "the megatron-mech state", and a damaged detector state still says what is missing."""
    saved, _ = _hook()
    hook, _ = _hook()
    with pytest.raises(ValueError, match=r"^the megatron-mech state: the megatron-mech state has version 99, .* written by another megatron-mech version"):
        hook.load_state_dict({**saved.state_dict(), "version": 99}, source=None)
    mech = saved.state_dict()
    del mech["detectors"]["unmonitored"]
    hook, view = _hook()
    hook.load_state_dict(mech, source=None)
    with pytest.raises(ValueError, match="^the megatron-mech state: .*missing entry 'unmonitored'"):
        hook.setup(view, None, start_step=5)


def test_naming_damaged_state_knows_an_error_that_names_its_source_by_its_type_not_its_text():
    """A StateError (it names its source) passes on unchanged, also through an enclosing context; any other error
    is named as damaged state, even one whose text happens to begin with the source's name."""
    from megatron_mech.hook import StateError, naming_damaged_state

    named = StateError("checkpoint file a.pt", "checkpoint file a.pt was saved with --mech-interval 10")
    with pytest.raises(StateError) as info:
        with naming_damaged_state("checkpoint file a.pt"):
            with naming_damaged_state("checkpoint file a.pt"):
                raise named
    assert info.value is named
    with pytest.raises(StateError) as info:
        with naming_damaged_state("checkpoint file a.pt"):
            raise ValueError("checkpoint file a.pt: the number 3 is not a list")  # a raw check's own text
    assert str(info.value) == ("checkpoint file a.pt: the megatron-mech state is damaged or was written by another "
                               "configuration (ValueError: checkpoint file a.pt: the number 3 is not a list)")


@pytest.mark.parametrize("key,value,why", [
    ("median", math.nan, "median must be a finite number"), ("scale", math.inf, "scale must be a finite number"),
    ("mad", -1.0, "mad >= 0"), ("n_warmup", -10 ** 6, "n_warmup must be an int >= 0"),
    ("n_out", 2.5, "n_out must be an int"),
    ("values", [0.5, math.nan], "values must be a finite number"),
])
def test_a_detector_state_that_would_silence_alerts_is_refused_by_file(tmp_path, key, value, why):
    """A detector state with a NaN or infinite baseline scores nothing, and a negative warm-up count keeps the detector in warm-up for as many evaluations: either would switch alerting off
    for the rest of the run with '0 alerts'. The load refuses it, naming the checkpoint file, the series and the
    entry."""
    saved, _ = _hook()
    for step in range(1, 61):  # 30 warm-up + 20 baseline evaluations of the loss rule, then monitoring
        saved.registry.update(step, {"symptom/loss": 2.0 + 0.01 * (step % 3)})
    assert saved.registry.detectors["symptom/loss"].phase == "monitoring"
    mech = saved.state_dict()
    mech["detectors"]["detectors"]["symptom/loss"][key] = value
    run, path = _checkpoint(tmp_path, mech=mech)
    hook, view = _hook()
    load_checkpoint(run, *_model_and_optimizer(), layout={}, hook=hook)
    with pytest.raises(ValueError, match=why) as info:
        hook.setup(view, None, start_step=5)
    assert str(path) in str(info.value) and "'symptom/loss'" in str(info.value)


def test_a_detector_state_saved_with_a_longer_warm_up_resumes_monitoring(tmp_path):
    """A run resumed with a shorter --mech-detector-warmup than it was saved with: the saved warm-up count is past
    the configured one, which means the warm-up is over, not a damaged state. The detector goes on monitoring
    with its saved baseline and scores the next evaluation against it."""
    saved, _ = _hook()
    for step in range(1, 61):
        saved.registry.update(step, {"symptom/loss": 2.0 + 0.01 * (step % 3)})
    run, _ = _checkpoint(tmp_path, mech=saved.state_dict())
    hook, view = _hook()
    hook.registry = type(hook.registry)([dataclasses.replace(r, warmup=5) for r in hook.registry.rules])
    load_checkpoint(run, *_model_and_optimizer(), layout={}, hook=hook)
    hook.setup(view, None, start_step=5)
    det = hook.registry.detectors["symptom/loss"]
    assert det.phase == "monitoring" and det.baseline_median == saved.registry.detectors["symptom/loss"].baseline_median
    assert hook.registry.update(61, {"symptom/loss": 2.01}) == []


# ------------------------------------------------------------- the distributed optimizer's parameter state file
TINY_GPT = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "32",
            "--micro-batch-size", "2", "--global-batch-size", "2", "--lr-warmup-iters", "1", "--log-interval", "1",
            "--eval-iters", "1", "--mech-interval", "2", "--use-distributed-optimizer"]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_planted_distributed_optimizer_state_does_not_run_even_when_torch_is_told_to_unpickle(tmp_path):
    """``distopt_rank0000.pt`` is read weights-only by us: with ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` (which makes
    a plain ``torch.load`` unpickle anything) a planted pickle that would create a marker file is refused naming
    the file, before training, and the marker never appears; the genuine file still resumes under the variable."""
    from dist_utils import REPO_ROOT, run_torchrun

    launcher = REPO_ROOT / "launch_scripts" / "pretrain_gpt_mech.py"
    run = tmp_path / "run"
    run_torchrun(launcher, *TINY_GPT, "--train-iters", "4", "--save", str(run), nproc=1, timeout=120)
    target = run / "iter_0000004" / "distopt_rank0000.pt"
    genuine = target.read_bytes()
    marker = tmp_path / "pwned"
    torch.save({"buckets": _Payload(marker)}, target)
    unsafe = {"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}
    resume = [*TINY_GPT, "--train-iters", "6", "--save", str(run), "--load", str(run)]
    with pytest.raises(AssertionError) as failure:
        run_torchrun(launcher, *resume, nproc=1, timeout=120, extra_env=unsafe)
    text = str(failure.value)
    assert not marker.exists(), text[-3000:]  # the payload never ran
    assert f"cannot read checkpoint file {target}" in text and "weights_only=True" in text, text[-3000:]
    assert "[train] step" not in text, text[-3000:]  # refused before training resumed
    target.write_bytes(genuine)
    resumed = run_torchrun(launcher, *resume, nproc=1, timeout=120, extra_env=unsafe)
    assert "[train] step     6/6" in resumed.stdout, resumed.stdout[-3000:]
