"""Skip the tests of a module when an optional package is absent, without importing it at collection.

``pytest.importorskip`` at module level imports the package while pytest collects, which for megatron-core,
DeepSpeed, transformers or peft costs seconds even when every test of the module is deselected (``-m "not slow"``).
``requires`` only looks the package up (``importlib.util.find_spec``); the tests import it where they use it.
"""
from __future__ import annotations

import importlib.util

import pytest


def _absent(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is None
    except ModuleNotFoundError:  # its parent package is absent (``megatron`` for ``megatron.core``)
        return True


def requires(*modules: str) -> pytest.MarkDecorator:
    """A ``skipif`` marker naming the modules of ``modules`` that are not installed."""
    missing = [name for name in modules if _absent(name)]
    return pytest.mark.skipif(bool(missing), reason=f"could not import {', '.join(missing)}: not installed")
