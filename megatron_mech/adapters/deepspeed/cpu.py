"""Running DeepSpeed on machines without an accelerator (CPU, gloo): what has to be set up first.

* ``import deepspeed`` selects its CPU accelerator by itself and uses gloo when the oneCCL bindings are
  absent.
* Every process-group initialisation compiles a shared-memory all-reduce extension (``deepspeed_shm_comm``,
  about 85 s on a small machine, ``-march=native`` so its cache must not be shared across machines). gloo
  does not need it: :func:`skip_shm_comm_build` replaces the builder with a no-op before
  ``deepspeed.init_distributed``.
* A single process without a launcher needs the rendezvous variables: :func:`single_process_env`.
"""
from __future__ import annotations

import os

__all__ = ["skip_shm_comm_build", "single_process_env"]


def skip_shm_comm_build() -> None:
    """Make DeepSpeed's torch backend skip building the shared-memory comm extension (CPU runs only)."""
    import importlib

    # importlib, not ``import deepspeed.comm.torch as m``: the package re-exports the real ``torch`` under
    # that attribute name, so the ``as`` form would bind the torch module itself.
    module = importlib.import_module("deepspeed.comm.torch")
    module.build_shm_op = lambda: None


def single_process_env(port: int = 29511) -> None:
    """Set ``RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 MASTER_ADDR/PORT`` unless a launcher already did."""
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", str(port))):
        os.environ.setdefault(key, value)
