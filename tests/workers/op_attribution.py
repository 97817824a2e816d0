"""Count the torch ops that given code issues, per optimizer step, under a ``TorchDispatchMode`` (collectives and host
syncs included: ``c10d.*``, ``aten._local_scalar_dense``), for the idle-step workers.

An op belongs to the counted code when the innermost frame that is counted code or *other* code (torch, the
standard library and the ``pass_through`` files are looked through) is counted code; its key is
``"<file>:<function>:<op>"``, the file relative to the repository. Only ops issued while a step is open
(:meth:`OpsPerStep.open` … :meth:`OpsPerStep.close`) count; every opened step gets an entry, also one without ops.

The workers run as scripts under torchrun, so ``import op_attribution`` finds this file in the script's own
directory.
"""
from __future__ import annotations

import collections
import os
import sys
from typing import Iterable, Optional

from torch.utils._python_dispatch import TorchDispatchMode

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class OpsPerStep(TorchDispatchMode):
    """``counted``: path prefixes of the code whose ops count; ``other``: path prefixes, or fragments found anywhere
    in a path (``contains``), of code whose ops do not; ``pass_through``: files looked through."""

    def __init__(self, counted: Iterable[str], other: Iterable[str] = (), contains: Iterable[str] = (),
                 pass_through: Iterable[str] = ()):
        super().__init__()
        self.counted, self.other = tuple(counted), tuple(other)
        self.contains, self.pass_through = tuple(contains), set(pass_through)
        self.step: Optional[int] = None
        self.ops: dict = collections.defaultdict(collections.Counter)

    def open(self, step: int) -> None:
        self.step = int(step)
        self.ops[self.step]  # noqa: B018 - every opened step gets an entry

    def close(self) -> None:
        self.step = None

    def _owner(self) -> Optional[str]:
        frame = sys._getframe(2)  # the caller of __torch_dispatch__, which called _owner
        while frame is not None:
            name = frame.f_code.co_filename
            if name not in self.pass_through:
                if name.startswith(self.counted):
                    return f"{os.path.relpath(name, REPO_ROOT)}:{frame.f_code.co_name}"
                if name.startswith(self.other) or any(fragment in name for fragment in self.contains):
                    return None
            frame = frame.f_back
        return None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        where = self._owner() if self.step is not None else None
        if where is not None:
            op = func.overloadpacket.__name__ if func.namespace == "aten" else f"{func.namespace}.{func.__name__}"
            self.ops[self.step][f"{where}:{op}"] += 1
        return func(*args, **(kwargs or {}))

    def as_json(self) -> dict:
        """``{step: {"<file>:<function>:<op>": count}}`` with string keys, steps in order."""
        return {str(step): dict(ops) for step, ops in sorted(self.ops.items())}
