"""What each way of running megatron-mech needs installed, checked before anything launches.

A missing package used to surface one at a time: after torchrun had started (``No module named 'megatron'``), or
as the first missing corpus package of two. :func:`missing_packages` looks every package of a path up at once
(``importlib.util.find_spec``, nothing imported) and returns one message naming all that are missing, the path's
extra once, and the corpus packages' own install command when the path trains on the embedded corpus.

The lists mirror the extras of ``pyproject.toml`` (``tests/integration/cli/test_path_packages.py`` checks they agree); a
package is named by its distribution, as pip spells it, and looked up by the module it installs.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import List, Optional, Tuple

from megatron_mech.adapters.megatron_core.corpus import missing_corpus_packages

__all__ = ["DEEPSPEED_LAUNCHER", "ENTRY_POINT", "MEGATRON_LM_FORK", "RunPath", "missing_packages"]


@dataclass(frozen=True)
class RunPath:
    """A way of running the package: what the user runs (``what``), its extra, the packages of that extra as
    ``(module, distribution)`` pairs, and whether it trains on the embedded corpus."""

    what: str
    extra: str
    packages: Tuple[Tuple[str, str], ...]
    corpus: bool


ENTRY_POINT = RunPath("our entry point (megatron-mech train / demo)", "megatron", (
    ("megatron.core", "megatron-core"), ("psutil", "psutil"), ("matplotlib", "matplotlib"),
    ("tensorboard", "tensorboard"), ("tokenizers", "tokenizers")), corpus=True)
DEEPSPEED_LAUNCHER = RunPath("the DeepSpeed launcher (megatron_mech.launch_scripts.deepspeed_train)", "deepspeed", (
    ("deepspeed", "deepspeed"), ("transformers", "transformers")), corpus=True)
MEGATRON_LM_FORK = RunPath("a Megatron-LM fork's pretrain_gpt.py", "megatron-lm", (
    ("megatron.core", "megatron-core"), ("psutil", "psutil"), ("six", "six"), ("regex", "regex"),
    ("pydantic", "pydantic"), ("pybind11", "pybind11"), ("triton", "triton"), ("yaml", "pyyaml"),
    ("packaging", "packaging")), corpus=False)


def _absent(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is None
    except (ImportError, ValueError):  # a parent package is absent (``megatron`` for ``megatron.core``)
        return True


def missing_distributions(path: RunPath) -> List[str]:
    """The distributions of ``path``'s extra that are not installed, in the extra's order."""
    return [distribution for module, distribution in path.packages if _absent(module)]


def missing_packages(path: RunPath) -> Optional[str]:
    """One message naming every package ``path`` needs that is not installed, with the install commands (the
    path's extra once; the corpus packages, installed without their dependencies, when the path trains on the
    embedded corpus), or ``None`` when nothing is missing."""
    missing = missing_distributions(path)
    corpus = missing_corpus_packages() if path.corpus else []
    if not missing and not corpus:
        return None
    names = missing + [name for name, _ in corpus]
    commands = []
    if missing:
        commands.append(f"pip install 'megatron-mech[{path.extra}]' (in a clone: pip install '.[{path.extra}]')")
    if corpus:
        commands.append("pip install --no-deps " + " ".join(f"{name}=={version}" for name, version in corpus)
                        + " (the corpus packages)")
    return f"{path.what} needs packages that are not installed: {', '.join(names)}. Install: {'; '.join(commands)}"
