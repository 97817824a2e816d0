"""Run a Megatron-LM fork's script on Python 3.11: ``python fork_on_py311.py FORK/pretrain_gpt.py ARGS...``.

Megatron-LM core_v0.18 and later declare Python >= 3.12, and their training layer uses that release's one new
name it needs, ``typing.override`` (``megatron/training/models/hybrid.py``), at import time, before any line of
the patch set runs. ``typing.override`` only marks a method (PEP 698: it sets ``__override__`` and returns the
method), so the backport below is exact. Everything else runs as under ``python FORK/pretrain_gpt.py``: the
script's directory first on ``sys.path``, ``__main__`` as its name, the arguments after it in ``sys.argv``.
"""
import runpy
import sys
import typing
from pathlib import Path


def override(method):
    try:
        method.__override__ = True
    except (AttributeError, TypeError):
        pass
    return method


if __name__ == "__main__":
    if not hasattr(typing, "override"):
        typing.override = override
    script = Path(sys.argv[1]).resolve()
    sys.argv = [str(script), *sys.argv[2:]]
    sys.path[0] = str(script.parent)
    runpy.run_path(str(script), run_name="__main__")
