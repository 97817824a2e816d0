"""Loading a checkpoint never runs code from it (our per-rank files are read with ``weights_only=True``), and a
checkpoint that does not fit the run (MoLS on/off) is refused by name before anything is loaded.

The reference is the payload itself: a crafted ``rank0000.pt`` whose pickle would create a marker file (through
``os.system``, as a real attack would) must be refused with an error naming the file, and the marker must not
exist afterwards. A genuine file of the same shape (tensors and plain data) still loads.
"""
from __future__ import annotations

import os

import pytest
import torch

from megatron_mech.megatron.checkpoint import TRACKER, load_checkpoint, read_checkpoint_file


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
