"""Checkpoint loads of MoLS param groups under megatron-core's two matching rules (see
``megatron_mech.adapters.megatron_lm_fork.param_group_loading``): with 0.16–0.18's keys MoLS's own protection suffices and the
version guard adds nothing; with 0.19's keys (``max_lr``/``min_lr`` identify groups; simulated on 0.16.1 by
setting its key tuple) scaled groups no longer match without the guard and load one-to-one with it."""
from __future__ import annotations

import json

import pytest

from dist_utils import REPO_ROOT, run_worker_jobs

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

WORKER = REPO_ROOT / "tests" / "workers" / "lm_param_groups_worker.py"


def _rank0(results, job):
    assert results[job]["ok"], json.dumps(results[job], indent=1)[-6000:]
    return results[job]["ranks"][0]


def test_version_guard_for_override_keys():
    jobs = [dict(id="keys_016", keys="0.16"), dict(id="keys_019", keys="0.19")]
    results = run_worker_jobs(WORKER, jobs, timeout=300)
    old, new = _rank0(results, "keys_016"), _rank0(results, "keys_019")
    assert old["identify"] is False and new["identify"] is True
    assert old["mols_protection_only"]["loaded"] and old["mols_protection_only"]["match"]
    assert old["with_version_guard"]["added"] == [] and old["with_version_guard"]["match"]
    assert not new["mols_protection_only"]["loaded"]
    assert "Could not find parameter group" in new["mols_protection_only"]["error"]
    assert new["with_version_guard"]["added"] == ["max_lr", "min_lr", "wd_mult"]
    assert new["with_version_guard"]["loaded"] and new["with_version_guard"]["match"]
