"""Safety of the DeepSpeed adapter's inputs: checkpoints are loaded weights-only (a planted pickle is refused and
never runs, a real checkpoint of every ZeRO stage resumes exactly), and the example launcher refuses to mix a
fresh run into a directory that already holds one."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dist_utils import REPO_ROOT, run_torchrun

deepspeed = pytest.importorskip("deepspeed")
transformers = pytest.importorskip("transformers")

WORKER = REPO_ROOT / "tests" / "workers" / "deepspeed_worker.py"


@pytest.mark.timeout(500)
def test_checkpoint_loads_weights_only_zero_0_to_3(tmp_path):
    """Real ZeRO 0-3 checkpoints pass the allow-list and resume exactly; planted model/optimizer pickles are
    refused by name and their side effect never happens (see scenario_safe_load)."""
    out = run_torchrun(WORKER, "--scenario", "safe_load", "--stages", "0,1,2,3", "--tmp", str(tmp_path), nproc=1,
                       timeout=450).stdout
    assert "DEEPSPEED_WORKER PASS" in out, out[-4000:]
    assert not list(tmp_path.glob("zero*/PWNED_optim_states"))
