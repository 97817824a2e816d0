"""Launching our entry point on this machine: the torchrun command line of a small training run, the entry
point's own flag check applied before anything launches, and running a command while naming why a worker failed
(the ``train`` and ``demo`` commands, the studies and the benchmarks use these)."""
from __future__ import annotations

import re
import sys
from typing import Callable, List, Optional, Sequence, Tuple

__all__ = ["check_training_flags", "run_training", "torchrun_prefix", "train_command", "worker_reason"]


def torchrun_prefix(nproc: int) -> List[str]:
    """``python -m torch.distributed.run --standalone --nproc_per_node=N`` with this interpreter (one node)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]


def train_command(nproc: int, steps: int, out: str, dense: bool = False, extra=()) -> List[str]:
    """The torchrun command line the ``train`` subcommand runs (also used by the demo and benchmarks).

    The preset's LR warm-up is kept when it fits (it must be shorter than the run) and otherwise becomes a tenth
    of the steps (:func:`megatron_mech.trainers.megatron_core.presets.fit_lr_warmup`); a ``--lr-warmup-iters`` in
    ``extra`` wins either way (the last one counts)."""
    from megatron_mech.trainers.megatron_core.presets import fit_lr_warmup, small_moe

    preset = fit_lr_warmup([*small_moe(nproc, dense), "--log-interval", "10", "--eval-interval", "100"], steps)
    return [*torchrun_prefix(nproc), "-m", "megatron_mech.trainers.megatron_core.pretrain_gpt", *preset,
            "--train-iters", str(steps), "--save", out, "--tensorboard-dir", f"{out}/tb",
            *[a for a in extra if a != "--"]]


def check_training_flags(cmd: List[str], nproc: int,
                         entry_module: str = "megatron_mech.trainers.megatron_core.pretrain_gpt",
                         extension_types: Sequence[type] = ()) -> Optional[str]:
    """The entry point's own start-up flag check (:func:`megatron_mech.trainers.megatron_core.flags.check_args`, and the
    hook extensions the entry point offers) on the flags after ``entry_module`` in a training command line, here, before
    torchrun launches anything: the error message, or None if they pass."""
    from megatron_mech.trainers.megatron_core.flags import build_parser, check_args, extensions_from_args

    parser = build_parser()
    parser.prog = "pretrain_gpt"

    def refuse(message: str):  # one line, not argparse's usage of every flag before it
        raise ValueError(message)

    parser.error = refuse
    for kind in extension_types:
        kind.add_arguments(parser)
    try:
        args = parser.parse_args(cmd[cmd.index(entry_module) + 1:])
        check_args(args, nproc)
        extensions_from_args(args, extension_types)
    except ValueError as exc:
        return str(exc)
    return None


# what a failed worker's reason looks like: our entry point's one-line refusal or its records-incomplete line, or an
# exception's last line
_REASON = re.compile(r"^(?:\[rank\d+\]: ?)?"  # torchrun's rank prefix
                     r"(pretrain_gpt: (?:error|records incomplete): .*"  # our entry point's own lines
                     r"|(?:[A-Za-z_][\w.]*)?(?:Error|Exception): \S.*)$")  # an exception's last line


def worker_reason(lines: List[str]) -> Optional[str]:
    """The first failure reason among a training command's output lines (the first worker to fail names the
    cause; the others then fail on closed connections), without torchrun's own summary."""
    for line in lines:
        match = _REASON.match(line.strip())
        if match and "ChildFailedError" not in line:
            return match.group(1)
    return None


def run_training(cmd: List[str], env: dict, show: Callable[[str], bool] = lambda line: True,
                 prefix: str = "") -> Tuple[int, Optional[str]]:
    """Run a training command, echoing (with ``prefix``) the output lines ``show`` accepts as they come; returns
    the exit code and, when it failed, the workers' one-line reason (see :func:`worker_reason`)."""
    import subprocess

    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    hidden, reason = [], None  # the last lines not echoed, shown if the run fails
    for line in proc.stdout:
        reason = reason or worker_reason([line])
        if show(line):
            print(f"{prefix}{line.rstrip()}", flush=True)
        else:
            hidden = (hidden + [line])[-40:]
    code = proc.wait()
    if code:
        print("".join(hidden), file=sys.stderr)
        print(f"{prefix}training failed (exit code {code}): {reason or 'no reason in its output; see above'}",
              file=sys.stderr, flush=True)
    return code, reason
