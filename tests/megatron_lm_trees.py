"""Megatron-LM trees for the patch-set tests: where they come from, how they are unpacked and patched.

The trees are unmodified Megatron-LM release snapshots, test data kept outside this repository. They are found
through ``$MEGATRON_MECH_LM_FIXTURES`` (default ``<repo>/../shared/fixtures/megatron-lm``, where CI has them): a
directory holding ``core_v<X.Y.Z>.tar.gz`` tarballs (each unpacking to ``Megatron-LM-core_v<X.Y.Z>/``) and/or
already unpacked ``Megatron-LM-core_v<X.Y.Z>/`` trees — point it at a directory with your own fork under such a
name to run the tests on it. Tests skip, saying why, when a tree is absent.
"""
from __future__ import annotations

import os
import shutil
import tarfile
from pathlib import Path
from typing import List, Optional

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
TAGS = ("core_v0.16.1", "core_v0.17.1", "core_v0.18.2", "core_v0.19.0")
RUNNABLE_TAG = "core_v0.16.1"  # trained at length by test_megatron_lm_e2e.py (the others: test_megatron_versions.py)
ENV = "MEGATRON_MECH_LM_FIXTURES"

# Megatron-LM flags of a CPU run (the fork's own flags; see megatron_mech.adapters.megatron_lm_fork.training_cpu_shims).
from megatron_mech.adapters.megatron_lm_fork.training_cpu_shims import CPU_TRAINING_FLAGS  # noqa: E402

# A small MoE GPT, EP=2 on 2 processes: 2 layers, hidden 64, 4 heads, 4 experts top-2, 2 micro-batches per step.
SMALL_MOE_FLAGS = (
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "128",
    "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "2", "--global-batch-size", "8",
    "--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "2",
    "--moe-token-dispatcher-type", "alltoall", "--disable-bias-linear", "--attention-dropout", "0",
    "--hidden-dropout", "0", "--lr", "1e-3", "--min-lr", "1e-4", "--lr-warmup-iters", "2",
    "--lr-decay-style", "cosine", "--seed", "1234", "--log-interval", "1", "--eval-interval", "100000",
    "--eval-iters", "0",
)


def fixtures_dir() -> Path:
    return Path(os.environ.get(ENV, REPO_ROOT.parent / "shared" / "fixtures" / "megatron-lm"))


def source(tag: str) -> Optional[Path]:
    """The unpacked tree or the tarball of ``tag``, or None."""
    root = fixtures_dir()
    tree = root / f"Megatron-LM-{tag}"
    if (tree / "megatron" / "training" / "training.py").is_file():
        return tree
    tarball = root / f"{tag}.tar.gz"
    return tarball if tarball.is_file() else None


def require(tag: str) -> Path:
    found = source(tag)
    if found is None:
        pytest.skip(f"Megatron-LM {tag} not found under {fixtures_dir()} (set ${ENV} to a directory holding "
                    f"{tag}.tar.gz or Megatron-LM-{tag}/)")
    return found


def unpack(tag: str, dest: Path) -> Path:
    """A private copy of the ``tag`` tree under ``dest`` (tests patch it in place)."""
    found = require(tag)
    target = dest / f"Megatron-LM-{tag}"
    if found.is_dir():
        shutil.copytree(found, target, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    else:
        with tarfile.open(found) as tar:
            tar.extractall(dest, filter="data")
    assert (target / "pretrain_gpt.py").is_file(), f"{found} did not unpack to {target}"
    return target


def available_tags() -> List[str]:
    return [t for t in TAGS if source(t) is not None]
