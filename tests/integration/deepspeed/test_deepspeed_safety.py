"""Safety of the DeepSpeed adapter's inputs: checkpoints are loaded weights-only (a planted pickle is refused and
never runs, a real checkpoint of every ZeRO stage resumes exactly), and the example launcher refuses to mix a
fresh run into a directory that already holds one."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from dist_utils import REPO_ROOT, hold_run_claim, run_torchrun
from optional_packages import requires

pytestmark = requires("deepspeed", "transformers")

WORKER = REPO_ROOT / "tests" / "workers" / "deepspeed_worker.py"


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(500)
def test_checkpoint_loads_weights_only_zero_0_to_3(tmp_path):
    """Real ZeRO 0-3 checkpoints pass the allow-list and resume exactly; planted model/optimizer pickles are
    refused by name and their side effect never happens (see scenario_safe_load)."""
    out = run_torchrun(WORKER, "--scenario", "safe_load", "--stages", "0,1,2,3", "--tmp", str(tmp_path), nproc=1,
                       timeout=450).stdout
    assert "DEEPSPEED_WORKER PASS" in out, out[-4000:]
    assert not list(tmp_path.glob("zero*/PWNED_optim_states"))


LAUNCHER = ("-m", "megatron_mech.trainers.deepspeed.train")
TINY = ("--mech-interval", "2", "--hidden", "16", "--layers", "1", "--heads", "2", "--kv-heads", "1", "--seq-len", "16",
        "--micro-batch", "2", "--warmup", "0")


def launch(*flags: str) -> subprocess.CompletedProcess:
    """One single-process run of the example launcher (it sets up the gloo rendezvous itself on CPU)."""
    from dist_utils import free_port

    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               MASTER_PORT=str(free_port()))
    return subprocess.run([sys.executable, *LAUNCHER, *TINY, *flags], env=env, cwd=REPO_ROOT, text=True,
                          capture_output=True, timeout=300)


def steps(jsonl) -> list:
    return [json.loads(line)["step"] for line in jsonl.read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_launcher_refuses_a_fresh_run_into_a_previous_run(tmp_path):
    """The example launcher follows the one-run-per-directory rule: a second fresh run into the same --output-dir
    (or --save) stops before building anything, with one line naming the directory; --load resumes (through the
    weights-only loader); --overwrite-run starts over instead of appending."""
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    first = launch("--steps", "4", "--output-dir", str(out), "--save", str(ckpt))
    assert first.returncode == 0, first.stderr[-3000:]
    assert steps(out / "mech.jsonl") == [2, 4]
    for flags, named in ((("--output-dir", str(out)), str(out)),
                         (("--output-dir", str(tmp_path / "new"), "--save", str(ckpt)), str(ckpt / "latest"))):
        again = launch("--steps", "4", *flags)
        assert again.returncode == 2, again.stderr[-3000:]
        error = again.stderr.strip().splitlines()
        assert len(error) == 1 and error[0].startswith("deepspeed_train: error: ") and named in error[0], error
        assert "--overwrite-run" in error[0]
    assert steps(out / "mech.jsonl") == [2, 4]  # untouched
    resumed = launch("--steps", "6", "--output-dir", str(out), "--load", str(ckpt))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert steps(out / "mech.jsonl") == [2, 4, 6]
    over = launch("--steps", "4", "--output-dir", str(out), "--save", str(ckpt), "--overwrite-run")
    assert over.returncode == 0, over.stderr[-3000:]
    assert steps(out / "mech.jsonl") == [2, 4]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_launcher_refuses_a_directory_another_run_holds(tmp_path):
    """Two runs started into one --output-dir at once both passed the one-run rule and appended to one
    mech.jsonl. With the first run's claim held here, the second stops before building anything: exit code 2,
    one line naming the directory and saying another run holds it, nothing written."""
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    for claimed, flag in ((out, "--output-dir"), (ckpt, "--save")):
        fd = hold_run_claim(claimed)
        try:
            second = launch("--steps", "4", "--output-dir", str(out), "--save", str(ckpt))
        finally:
            os.close(fd)
        assert second.returncode == 2, second.stderr[-3000:]
        error = [line for line in second.stderr.splitlines() if line.startswith("deepspeed_train: error: ")]
        assert error == [f"deepspeed_train: error: {flag} {claimed} is in use: another run (pid {os.getpid()} on "
                         f"the test) holds it (lock {claimed / '.mech_run.lock'}). Two runs writing one directory "
                         f"would mix their records and checkpoints; wait for that run to end or use another "
                         f"{flag}"], second.stderr[-3000:]
        assert not (out / "mech.jsonl").exists() and not (ckpt / "latest").exists()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_launcher_refuses_links_out_of_its_directories(tmp_path):
    """A mech.jsonl link in --output-dir got the records appended to the file it points to, and a (dangling)
    ``latest`` link in --save got DeepSpeed's tag written outside the directory. Both are refused before anything
    is built: exit code 2, one line naming the link, nothing written where they point."""
    out, ckpt, outside = tmp_path / "out", tmp_path / "ckpt", tmp_path / "outside"
    outside.mkdir()
    (outside / "records.jsonl").write_text("")
    for link, target in ((out / "mech.jsonl", outside / "records.jsonl"), (ckpt / "latest", outside / "latest")):
        link.parent.mkdir(exist_ok=True)
        link.symlink_to(target)
        run = launch("--steps", "4", "--output-dir", str(out), "--save", str(ckpt))
        assert run.returncode == 2, run.stderr[-3000:]
        error = [line for line in run.stderr.splitlines() if line.startswith("deepspeed_train: error: ")]
        assert len(error) == 1 and f"{link} is a symbolic link (to {target})" in error[0], run.stderr[-3000:]
        assert sorted(p.name for p in outside.iterdir()) == ["records.jsonl"]
        assert (outside / "records.jsonl").read_text() == ""
        link.unlink()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_launcher_refuses_a_linked_tag_directory_it_would_save_into(tmp_path):
    """A ``global_step4`` link in --save, where a fresh 4-step run saves its checkpoint, was found only when the
    save wrote through it, after training. It is refused before anything is built, naming the link; a link at
    a tag the run only reads (at or before the resumed step) is left alone."""
    out, ckpt, outside = tmp_path / "out", tmp_path / "ckpt", tmp_path / "outside"
    outside.mkdir()
    ckpt.mkdir()
    (ckpt / "global_step4").symlink_to(outside, target_is_directory=True)
    run = launch("--steps", "4", "--output-dir", str(out), "--save", str(ckpt))
    assert run.returncode == 2, run.stderr[-3000:]
    error = [line for line in run.stderr.splitlines() if line.startswith("deepspeed_train: error: ")]
    assert len(error) == 1 and f"{ckpt / 'global_step4'} is a symbolic link (to {outside})" in error[0], error
    assert list(outside.iterdir()) == [] and not (out / "mech.jsonl").exists()


@pytest.mark.timeout(600)
def test_latest_tag_outside_the_load_directory_is_refused_and_the_loaded_checkpoint_is_named(tmp_path):
    """DeepSpeed joins whatever ``latest`` holds to --load: a tag ``../../ds1/ckpt/global_step4`` loaded another
    run's checkpoint, silently. It is refused (one line naming the ``latest`` file and the tag) before anything is
    loaded, and a genuine resume logs the checkpoint directory it loaded."""
    ds1 = tmp_path / "ds1"
    first = launch("--steps", "4", "--output-dir", str(ds1 / "out"), "--save", str(ds1 / "ckpt"))
    assert first.returncode == 0, first.stderr[-3000:]
    other = tmp_path / "ds2" / "ckpt"
    other.mkdir(parents=True)
    (other / "latest").write_text("../../ds1/ckpt/global_step4")
    out2 = tmp_path / "ds2" / "out"
    refused = launch("--steps", "6", "--output-dir", str(out2), "--load", str(other))
    assert refused.returncode == 2, refused.stderr[-3000:]
    error = [line for line in refused.stderr.splitlines() if line.startswith("deepspeed_train: error: ")]
    assert len(error) == 1, refused.stderr[-3000:]
    assert str(other / "latest") in error[0] and "'../../ds1/ckpt/global_step4'" in error[0], error
    assert "outside the checkpoint directory" in error[0], error
    assert not (out2 / "mech.jsonl").exists()  # nothing trained
    resumed = launch("--steps", "6", "--output-dir", str(ds1 / "out"), "--load", str(ds1 / "ckpt"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"loaded DeepSpeed checkpoint {ds1 / 'ckpt' / 'global_step4'}" in resumed.stderr, resumed.stderr[-3000:]


# ------------------------------------------------------------------ what the allowed DeepSpeed types receive
class _Crafted:
    """Pickles as ``func(*args)`` (then ``state`` written into the result, when given): what a crafted file holds."""

    def __init__(self, func, args, state=None):
        self.func, self.args, self.state = func, args, state

    def __reduce__(self):
        return (self.func, self.args) if self.state is None else (self.func, self.args, self.state)


def _crafted_states():
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    def dynamic(**changes):
        scaler = DynamicLossScaler(init_scale=2 ** 16, scale_window=1000, min_scale=1, delayed_shift=2,
                                   consecutive_hysteresis=False, dtype=torch.float16)
        scaler.__dict__.update(changes)
        return scaler

    return {
        "nan scale": (LossScaler(scale=float("nan")), "LossScaler with cur_scale=nan"),
        "zero scale": (LossScaler(scale=0.0), "LossScaler with cur_scale=0.0"),
        "inf dynamic scale": (dynamic(cur_scale=float("inf")), "DynamicLossScaler with cur_scale=inf"),
        "zero scale window": (dynamic(scale_window=0), "scale_window=0"),
        "attribute shadowing a method": (_Crafted(LossScaler, (2.0,), {"backward": None}), "'backward'"),
        "stage out of range": (_Crafted(ZeroStageEnum, (99,)), "ZeroStageEnum(99)"),
        "stage of another type": (_Crafted(ZeroStageEnum, ("1",)), "ZeroStageEnum('1')"),
        "fragment arguments": (_Crafted(fragment_address, ("a", "b", "c")), "TypeError"),
        "fragment of strings": (fragment_address(numel="4", start=0), "numel='4'"),
        "negative fragment": (fragment_address(numel=4, start=-1), "start=-1"),
        "a type for a value": (LossScaler, "type LossScaler itself"),
    }


# The names of _crafted_states' cases, listed here so that collecting this module imports no DeepSpeed.
CRAFTED_CASES = ("nan scale", "zero scale", "inf dynamic scale", "zero scale window", "attribute shadowing a method",
                 "stage out of range", "stage of another type", "fragment arguments", "fragment of strings",
                 "negative fragment", "a type for a value")


@pytest.mark.parametrize("case", CRAFTED_CASES)
def test_allowed_deepspeed_types_take_only_what_deepspeed_writes(tmp_path, case):
    """The reference is DeepSpeed's own constructors: each state below is one they never produce (a non-finite or
    zero loss scale, an unknown attribute, a ZeRO stage that does not exist, fragment bounds that are not
    non-negative ints, wrong constructor arguments, a bare type). Each is refused as a ``ValueError`` naming the
    file (the launcher reports those in one line); a genuine state of every allowed type still loads."""
    from megatron_mech.adapters.deepspeed.safe_load import _weights_only_load

    states = _crafted_states()
    assert list(states) == list(CRAFTED_CASES)  # every crafted state is a case
    obj, named = states[case]
    path = tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": {"loss_scaler": obj, "param_slice_mappings": [{}]}}, path)
    with pytest.raises(ValueError) as info:
        _weights_only_load(str(path))
    assert str(path) in str(info.value) and named in str(info.value), str(info.value)


def test_genuine_states_of_the_allowed_deepspeed_types_load(tmp_path):
    from deepspeed.runtime.fp16.loss_scaler import CreateLossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    from megatron_mech.adapters.deepspeed.safe_load import _weights_only_load

    dynamic_args = dict(init_scale=2 ** 16, scale_window=1000, min_scale=1, delayed_shift=2,
                        consecutive_hysteresis=False)
    state = {"zero_stage": ZeroStageEnum.gradients, "static": CreateLossScaler(torch.float32, 0, False, None),
             "dynamic": CreateLossScaler(torch.float16, 0, True, dynamic_args),
             "param_slice_mappings": [{"w": fragment_address(numel=4, start=0)}], "w": torch.arange(4.0)}
    torch.save(state, tmp_path / "optim_states.pt")
    loaded = _weights_only_load(str(tmp_path / "optim_states.pt"))
    assert loaded["zero_stage"] is ZeroStageEnum.gradients
    assert vars(loaded["dynamic"]) == vars(state["dynamic"]) and vars(loaded["static"]) == vars(state["static"])
    assert loaded["param_slice_mappings"] == state["param_slice_mappings"]


def test_a_crafted_state_is_never_written_into_a_shared_zero_stage_member(tmp_path):
    """``ZeroStageEnum(1)`` followed by a state ``{"_value_": 99}``: the unpickler wrote it into the process-wide
    enum member (every ``ZeroStageEnum.optimizer_states`` then read 99). Refused naming the file; the member is
    untouched."""
    from deepspeed.runtime.zero.config import ZeroStageEnum

    from megatron_mech.adapters.deepspeed.safe_load import _weights_only_load

    path = tmp_path / "optim_states.pt"
    torch.save({"zero_stage": _Crafted(ZeroStageEnum, (1,), {"_value_": 99})}, path)
    member = ZeroStageEnum.optimizer_states
    try:
        with pytest.raises(ValueError, match=str(path).replace(".", r"\.")):
            _weights_only_load(str(path))
        assert member.value == 1
    finally:
        member._value_ = 1  # what the unpickler may have overwritten: later tests use the enum


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_launcher_reports_a_damaged_fragment_address_in_one_line(tmp_path):
    """A ZeRO 1 optimizer file whose ``fragment_address`` gets wrong constructor arguments: DeepSpeed's TypeError
    escaped the launcher's handler as a traceback; it is one line naming the file, rc 2."""
    from deepspeed.utils.tensor_fragment import fragment_address

    from megatron_mech.adapters.deepspeed.safe_load import DEEPSPEED_CHECKPOINT_GLOBALS

    ckpt = tmp_path / "ckpt"
    first = launch("--steps", "2", "--zero-stage", "1", "--output-dir", str(tmp_path / "out"), "--save", str(ckpt))
    assert first.returncode == 0, first.stderr[-3000:]
    target = next((ckpt / "global_step2").glob("*optim_states.pt"))
    allowed = [getattr(__import__(m, fromlist=[n]), n) for m, n in DEEPSPEED_CHECKPOINT_GLOBALS]
    with torch.serialization.safe_globals(allowed):
        state = torch.load(target, weights_only=True)
    mappings = state["optimizer_state_dict"]["param_slice_mappings"][0]
    name = next(iter(mappings))
    assert isinstance(mappings[name], fragment_address)  # the genuine file holds one
    mappings[name] = _Crafted(fragment_address, ("a", "b", "c"))
    torch.save(state, target)
    resumed = launch("--steps", "4", "--zero-stage", "1", "--output-dir", str(tmp_path / "out"), "--load", str(ckpt))
    assert resumed.returncode == 2, resumed.stderr[-3000:]
    assert "Traceback" not in resumed.stderr, resumed.stderr[-3000:]
    error = [line for line in resumed.stderr.splitlines() if line.startswith("deepspeed_train: error: ")]
    assert len(error) == 1 and str(target) in error[0] and "fragment_address" in error[0], resumed.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_launcher_refuses_to_resume_into_another_runs_output_directory(tmp_path):
    """A resume appends to --output-dir's mech.jsonl and replaces its summary.json, so it must be the checkpoint's
    run's own: each run writes its id (run_id.txt) into --output-dir and into each checkpoint it saves, and a
    resume into an output directory of another run (another id, or records and no id) stops before writing
    anything, naming both directories. Its own directory, or an empty new one (which adopts the id), still
    resumes, and so does a checkpoint saved before run ids existed."""
    ds1, ds2 = tmp_path / "ds1", tmp_path / "ds2"
    first = launch("--steps", "4", "--output-dir", str(ds1), "--save", str(ds1 / "ckpt"))
    assert first.returncode == 0, first.stderr[-3000:]
    run_id = (ds1 / "run_id.txt").read_text()
    assert run_id and (ds1 / "ckpt" / "global_step4" / "run_id.txt").read_text() == run_id
    other = launch("--steps", "8", "--seed", "99", "--output-dir", str(ds2))
    assert other.returncode == 0, other.stderr[-3000:]
    assert (ds2 / "run_id.txt").read_text() != run_id
    kept = {name: (ds2 / name).read_bytes() for name in ("mech.jsonl", "summary.json")}
    assert steps(ds2 / "mech.jsonl") == [2, 4, 6, 8]
    for without_id in (False, True):  # records of a run from before run ids are not this checkpoint's either
        if without_id:
            (ds2 / "run_id.txt").unlink()
        refused = launch("--steps", "6", "--output-dir", str(ds2), "--load", str(ds1 / "ckpt"))
        assert refused.returncode == 2, refused.stderr[-3000:]
        error = refused.stderr.strip().splitlines()
        assert len(error) == 1 and error[0].startswith("deepspeed_train: error: "), error
        assert str(ds2) in error[0] and str(ds1 / "ckpt") in error[0], error
        assert "checkpoint's own output directory or at a new one" in error[0], error
        assert {name: (ds2 / name).read_bytes() for name in kept} == kept
    resumed = launch("--steps", "6", "--output-dir", str(ds1), "--load", str(ds1 / "ckpt"), "--save",
                     str(ds1 / "ckpt"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert steps(ds1 / "mech.jsonl") == [2, 4, 6]
    assert (ds1 / "run_id.txt").read_text() == run_id
    assert (ds1 / "ckpt" / "global_step6" / "run_id.txt").read_text() == run_id
    (ds1 / "ckpt" / "global_step6" / "run_id.txt").unlink()  # as saved before run ids existed
    new = tmp_path / "new"
    legacy = launch("--steps", "8", "--output-dir", str(new), "--load", str(ds1 / "ckpt"))
    assert legacy.returncode == 0, legacy.stderr[-3000:]
    assert steps(new / "mech.jsonl") == [8] and (new / "run_id.txt").read_text()
