"""Files that other libraries read during a monitored run, and what keeps them from running code (the table "Files
read by code that is not ours" of the reliability page).

megatron-core reads the run's sample-index cache (``gpt_index_cache/*.npy``, inside the run's directory) with
``numpy.load(allow_pickle=True, mmap_mode="r")``. It cannot run code only because numpy refuses to memory-map an
object array; these tests pin that on the installed megatron-core, with a real planted payload.
"""
from __future__ import annotations

import inspect
import os
import re
import shutil
import subprocess
import sys

import numpy
import pytest

from dist_utils import REPO_ROOT, communicate_all, free_port

LAUNCHER = REPO_ROOT / "launch_scripts" / "pretrain_gpt_mech.py"
TINY = ("--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "32",
        "--micro-batch-size", "2", "--global-batch-size", "2", "--lr-warmup-iters", "1", "--log-interval", "1",
        "--eval-iters", "1", "--mech-interval", "2", "--train-iters", "4")


class _Payload:
    """Unpickling it creates the file named ``marker``: proof that code from the file ran."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_megatron_core_memory_maps_every_index_cache_it_loads():
    """Every ``numpy.load`` of megatron-core's GPT and blended datasets passes ``mmap_mode``: without it,
    ``allow_pickle=True`` would unpickle a planted object array."""
    from megatron.core.datasets import blended_dataset, gpt_dataset

    for module in (gpt_dataset, blended_dataset):
        calls = re.findall(r"numpy\.load\(([^)]*)\)", inspect.getsource(module))
        assert calls, module.__name__
        for args in calls:
            assert "mmap_mode" in args, f"{module.__name__}: numpy.load({args}) is not memory-mapped"


def _run(output_dir) -> tuple[int, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=f"{REPO_ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1",
                             f"--master_port={free_port()}", str(LAUNCHER), *TINY, "--mech-output-dir", str(output_dir)],
                            env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    (out,) = communicate_all([proc], 240, what="pretrain_gpt_mech")
    return proc.returncode, out


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_pickle_planted_in_the_sample_index_cache_does_not_run(tmp_path):
    """A run whose ``gpt_index_cache`` holds a pickled object array in place of the sample index: megatron-core's
    load fails on the memory map, and the payload never runs."""
    code, out = _run(tmp_path / "first")
    assert code == 0, out[-3000:]
    planted = tmp_path / "second"
    shutil.copytree(tmp_path / "first" / "gpt_index_cache", planted / "gpt_index_cache")
    (sample_index,) = (planted / "gpt_index_cache").glob("*-train-sample_index.npy")
    marker = tmp_path / "payload_ran"
    payload = numpy.empty(1, dtype=object)
    payload[0] = _Payload(str(marker))
    with open(sample_index, "wb") as f:
        numpy.save(f, payload, allow_pickle=True)

    code, out = _run(planted)
    assert code != 0 and "memory-mapped" in out, out[-3000:]
    assert not marker.exists()
    numpy.load(sample_index, allow_pickle=True)  # the same load without the memory map: the payload is live
    assert marker.exists()
