"""The launchers of this folder; installed with the package as ``megatron_mech.launch_scripts`` (its ``DIRECTORY``)."""
from pathlib import Path

DIRECTORY = Path(__file__).resolve().parent
