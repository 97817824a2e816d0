"""The README's quick starts of the Megatron-LM fork and DeepSpeed paths, run verbatim in a directory outside the
checkout, each in a fresh environment holding the pinned torch and the wheel with that path's extra alone
(tests/installed_package.py ``install_path``: what pip resolves for the extra, nothing of the test environment);
the entry point's is tests/integration/cli/test_demo.py.

* Megatron-LM fork (``<!-- quickstart:megatron-lm -->``): on an unmodified core_v0.16.1 tree (skipped, saying why,
  without one: tests/megatron_lm_trees.py), ``patch check`` / ``patch apply`` then 20 steps of the fork's own
  ``pretrain_gpt.py`` with ``$FLAGS`` = the CPU flags and tests/megatron_lm_trees.py's small MoE on the embedded
  corpus: the tree ends patched and every evaluation is recorded. Then the fork guide's CPU command
  (``<!-- cpu-command:megatron-lm -->`` in docs/guides/megatron-lm.md), verbatim: it trains on Megatron's mock
  data, and its first line comes before Megatron's argument dump.
* DeepSpeed (``<!-- quickstart:deepspeed -->``): the launcher module trains 20 steps and records its evaluations.
"""
from __future__ import annotations

import json

import pytest

from dist_utils import free_port
from megatron_lm_trees import CPU_TRAINING_FLAGS, RUNNABLE_TAG, SMALL_MOE_FLAGS, require, unpack
from readme_blocks import marked_block, run_block, run_quickstart


def free_rendezvous_port() -> dict:
    """torchrun's ``--master-port`` through its environment variable, so the verbatim command meets no other run's
    rendezvous on this machine (torchrun's default port is fixed)."""
    return {"PET_MASTER_PORT": str(free_port())}


def steps_recorded(path) -> list:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_megatron_lm_quickstart_and_the_guides_cpu_command(path_install, tmp_path):
    require(RUNNABLE_TAG)
    installed_package = path_install("megatron-lm")
    from megatron_mech.trainers.data.embedded import prepare_data
    from megatron_mech.adapters.megatron_lm_fork import patcher

    fork = unpack(RUNNABLE_TAG, tmp_path / "fork")
    assert patcher.check(fork).state != "applied"  # the quick start is what patches it
    data = prepare_data(tmp_path / "corpus", vocab_size=1024, max_docs_per_source=40, quiet=True)
    flags = [*CPU_TRAINING_FLAGS, *SMALL_MOE_FLAGS, "--tokenizer-type", "NullTokenizer", "--vocab-size",
             str(data.vocab_size), "--data-path", str(data.train_prefix), "--split", "98,2,0", "--data-cache-path",
             str(tmp_path / "index_cache")]
    assert not any(" " in f for f in flags)  # $FLAGS is split on spaces by the shell, as a user's would be
    work = tmp_path / "work"
    work.mkdir()
    out = run_quickstart("megatron-lm", installed_package, work,
                         {"MEGATRON_LM": str(fork), "FLAGS": " ".join(flags), **free_rendezvous_port()}, timeout=840)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert patcher.check(fork).state == "applied"
    assert steps_recorded(work / "runs" / "fork" / "mech.jsonl") == [5, 10, 15, 20]

    guide = tmp_path / "guide"
    guide.mkdir()
    out = run_block(marked_block("docs/guides/megatron-lm.md", "cpu-command:megatron-lm"), installed_package, guide,
                    {"MEGATRON_LM": str(unpack(RUNNABLE_TAG, tmp_path / "fork2")), **free_rendezvous_port()},
                    timeout=840)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert steps_recorded(guide / "runs" / "fork" / "mech.jsonl") == [5, 10, 15, 20]
    # the line printed before pretrain() parses the arguments (on stderr, unbuffered: a merged log has it before
    # Megatron's argument dump), ahead of the monitors' own start line at the first step
    early = "[mech] megatron-mech is on: monitors every 5 steps, records in runs/fork/mech.jsonl"
    both = out.stderr + out.stdout
    assert early in out.stderr and both.index(early) < both.index("[mech] monitors on:"), out.stderr[:3000]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_deepspeed_quickstart(path_install, tmp_path):
    installed_package = path_install("deepspeed,corpus")
    out = run_quickstart("deepspeed", installed_package, tmp_path, free_rendezvous_port(), timeout=840)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    run = tmp_path / "runs" / "ds"
    assert steps_recorded(run / "mech.jsonl") == [10, 20]
    assert json.loads((run / "summary.json").read_text())  # the run's summary, written at the end
