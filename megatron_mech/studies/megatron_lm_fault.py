"""Run a patched Megatron-LM fork's ``pretrain_gpt.py`` with the studies' ``--mech-fault*`` flags::

    torchrun --nproc_per_node=2 -m megatron_mech.studies.megatron_lm_fault <fork>/pretrain_gpt.py <its flags> \\
        --spec megatron_mech.adapters.megatron_lm_fork.fault_spec layer_spec \\
        --mech-fault attention --mech-fault-start 100

:func:`main` offers the :class:`~megatron_mech.studies.injectors.FaultInjector` to the fork's call sites
(:func:`megatron_mech.adapters.megatron_lm_fork.callsites.register_extension`), then runs the fork's script as
``__main__`` with the rest of the command line, as if it had been started itself: the patch's ``extra_args_provider``
adds the fault flags, the hook registers the injector they ask for, and ``--spec ...fault_spec layer_spec`` builds its
attention into the model.
"""
from __future__ import annotations

import runpy
import sys
from pathlib import Path
from typing import List, Optional

from megatron_mech.adapters.megatron_lm_fork.callsites import register_extension
from megatron_mech.studies.injectors import FaultInjector

__all__ = ["main"]


def main(argv: Optional[List[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or not argv[0].endswith(".py") or not Path(argv[0]).is_file():
        raise SystemExit("megatron_lm_fault: error: the first argument must be the fork's pretrain_gpt.py, got "
                         f"{argv[0] if argv else 'nothing'}")
    script = Path(argv[0]).resolve()
    register_extension(FaultInjector)
    sys.argv = [str(script), *argv[1:]]
    sys.path.insert(0, str(script.parent))  # as when the script is started itself
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
