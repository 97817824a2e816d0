"""``megatron-mech`` subcommands refuse bad input with one line naming the flag, before launching anything."""
import subprocess
import sys

import pytest

from dist_utils import REPO_ROOT
from megatron_mech.cli import train_command


def cli(*args):
    return subprocess.run([sys.executable, "-m", "megatron_mech.cli", *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("args,message", [
    (["train", "--nproc", "0"], "--nproc must be >= 1, got 0"),
    (["train", "--steps", "0"], "--steps must be >= 1, got 0"),
    (["train", "--mech-interval", "0"], "training flags go after '--'"),
    (["demo", "--steps", "200"], "--fault-start 300 is not before --steps 200"),
])
def test_bad_subcommand_input_is_named(args, message):
    out = cli(*args)
    assert out.returncode == 2 and message in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr


def test_short_train_scales_the_preset_warmup():
    """``train --steps 20`` used to fail on the preset's --lr-warmup-iters 30, a flag the user never set."""
    def warmup(cmd):
        return int(cmd[len(cmd) - 1 - cmd[::-1].index("--lr-warmup-iters") + 1])  # the last one wins (argparse)

    assert warmup(train_command(2, 20, "out")) == 2 < 20
    assert warmup(train_command(2, 300, "out")) == 50  # the preset's, where it fits
    assert warmup(train_command(2, 20, "out", extra=["--", "--lr-warmup-iters", "5"])) == 5  # the user's wins
