"""torchrun worker: the real training entry point with some packages made unimportable.

Usage: ``torchrun ... blocked_import_worker.py PACKAGE[,PACKAGE...] <pretrain_gpt flags>``. Each package is set
to ``None`` in ``sys.modules`` before anything is imported, which makes ``import PACKAGE`` raise ``ImportError``
exactly as for a package that is not installed, whatever this machine has installed.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

for blocked in sys.argv[1].split(","):
    sys.modules[blocked] = None

from megatron_mech.trainers.megatron_core.pretrain_gpt import main  # noqa: E402

if __name__ == "__main__":
    main(sys.argv[2:])
