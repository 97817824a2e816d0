"""``megatron-mech`` command line (also ``python -m megatron_mech.cli``).

Adding a subcommand: write ``_add_<name>(parser)`` (declare options) and ``_run_<name>(args) -> int``
(import heavy dependencies *inside* it, so ``megatron-mech --help`` stays fast), then register both in
``SUBCOMMANDS`` with a one-line help string.
"""
from __future__ import annotations

import argparse
import sys
from typing import Callable, Dict, List, NamedTuple, Optional

from megatron_mech.options import closest_name
from megatron_mech.records.run_directory import RECORDS_INCOMPLETE_EXIT
from megatron_mech.records.safe_files import write_file_atomically
from megatron_mech.trainers.megatron_core.launch import check_training_flags, run_training, train_command


class Subcommand(NamedTuple):
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


# ---------------------------------------------------------------------------------------------------
# prepare-data
# ---------------------------------------------------------------------------------------------------
def _add_prepare_data(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out-dir", default=None,
                   help="output directory (default: $MEGATRON_MECH_DATA/<key> or ~/.cache/megatron_mech/data/<key>)")
    p.add_argument("--vocab-size", type=int, default=8192, help="BPE vocabulary size (default 8192)")
    p.add_argument("--valid-fraction", type=float, default=0.02,
                   help="fraction of documents held out for validation (default 0.02)")
    p.add_argument("--max-docs-per-source", type=int, default=None,
                   help="keep only the first N documents of each source (quick runs / tests)")
    p.add_argument("--force", action="store_true", help="rebuild even if a valid cache exists")
    p.add_argument("--quiet", action="store_true", help="no progress messages on stderr")


def _run_prepare_data(args: argparse.Namespace) -> int:
    import time

    from megatron_mech.trainers.data.embedded import MissingDataPackageError, prepare_data

    t0 = time.perf_counter()
    try:
        paths = prepare_data(args.out_dir, vocab_size=args.vocab_size, valid_fraction=args.valid_fraction,
                             force=args.force, max_docs_per_source=args.max_docs_per_source, quiet=args.quiet)
    except (MissingDataPackageError, OSError) as e:  # e.g. a read-only target: one line, not a traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    meta = paths.meta
    print(f"data dir:       {paths.root}")
    print(f"train prefix:   {paths.train_prefix}")
    print(f"valid prefix:   {paths.valid_prefix}")
    print(f"tokenizer:      {paths.tokenizer_path}  (vocab {meta['tokenizer']['vocab_size']}, "
          f"eod id {meta['tokenizer']['eod_id']}, {meta['tokenizer']['chars_per_token']} chars/token)")
    for split in ("train", "valid"):
        s = meta["splits"][split]
        print(f"{split + ' tokens:':15s} {s['tokens']:,} in {s['documents']} documents")
    for name, src in meta["sources"].items():
        print(f"source {name}: {src['package']}=={src['version']}, {src['tokens']['train']:,} train / "
              f"{src['tokens']['valid']:,} valid tokens")
    print(f"({time.perf_counter() - t0:.1f}s)")
    return 0


# ---------------------------------------------------------------------------------------------------
# train: the small MoE GPT on this machine, monitors on, then the report
# ---------------------------------------------------------------------------------------------------
def _add_train(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc", type=int, default=2, help="processes (torchrun --nproc_per_node)")
    p.add_argument("--steps", type=int, default=300, help="--train-iters")
    p.add_argument("--out", default="runs/small_moe", help="run directory (checkpoint, mech.jsonl, tb/, report)")
    p.add_argument("--dense", action="store_true", help="a dense GPT of the same shape instead of the MoE")
    p.add_argument("extra", nargs=argparse.REMAINDER,
                   help="after '--': more pretrain_gpt flags (they override the preset), e.g. -- --mech-interval 5")


def _check_counts(**counts: int) -> Optional[str]:
    """The first ``--name value`` that is not >= 1, as an error message (None if all are fine)."""
    for name, value in counts.items():
        if value < 1:
            return f"--{name.replace('_', '-')} must be >= 1, got {value}"
    return None


def _train_run_error(cmd: List[str], steps: int) -> Optional[str]:
    """What would end a ``train`` run with no report, or be refused by every worker, found before launching: a run
    shorter than the evaluation interval (nothing recorded), a package the sinks the flags ask for need
    (``tensorboard`` for the preset's ``--tensorboard-dir``), or an output directory the entry point refuses (its
    own rules, so the command exits 2 with one line instead of torchrun's 1 under every worker's output)."""
    from megatron_mech.records.report import REPORT_FILES
    from megatron_mech.records.run_directory import refuse_unsafe_files_in
    from megatron_mech.trainers.megatron_core.directory_checks import check_run_directories
    from megatron_mech.trainers.megatron_core.flags import build_parser
    from megatron_mech.trainers.megatron_core.sink_packages import sink_package_problem

    flags = build_parser().parse_args(cmd[cmd.index("megatron_mech.trainers.megatron_core.pretrain_gpt") + 1:])
    problem = sink_package_problem(flags.tensorboard_dir, flags.mech_wandb_project)
    if problem:
        return problem
    if steps < flags.mech_interval:
        return (f"--steps {steps} is shorter than --mech-interval {flags.mech_interval}: the monitors first evaluate "
                f"at step {flags.mech_interval}, so the run would record nothing to report. Use --steps "
                f"{flags.mech_interval} or more, or a shorter interval after '--' (e.g. -- --mech-interval {steps})")
    try:
        check_run_directories(flags, overwrite_flag="-- --overwrite-run (after the train options: megatron-mech train "
                                                    "... -- --overwrite-run)", other_dir_flags="--out")
        refuse_unsafe_files_in(flags.save, REPORT_FILES)  # the report is written beside the run's records
    except ValueError as exc:
        return str(exc)
    return None


def _run_train(args: argparse.Namespace) -> int:
    import os

    from megatron_mech.adapters.path_packages import ENTRY_POINT, missing_packages

    error = _check_counts(nproc=args.nproc, steps=args.steps) or missing_packages(ENTRY_POINT)
    if error is None:
        from megatron_mech.studies.pretrain_gpt_fault import study_flag_refusal

        error = study_flag_refusal(args.extra, "megatron-mech train")
    cmd = train_command(args.nproc, args.steps, args.out, args.dense, args.extra)
    error = (error or check_training_flags(cmd, args.nproc) or missing_plot_package()
             or _train_run_error(cmd, args.steps))
    if error:
        print(f"megatron-mech train: error: {error}", file=sys.stderr)
        return 2

    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    print("+ " + " ".join(cmd), flush=True)
    code, reason = run_training(cmd, env)
    incomplete = code != 0 and bool(reason) and reason.startswith("pretrain_gpt: records incomplete:")
    if code != 0 and not incomplete:
        # torchrun exits 1 whatever its workers' code; a refusal of the entry point's start-up checks is a usage
        # error (2, as documented) should one get past the checks above
        return 2 if reason and reason.startswith("pretrain_gpt: error:") else code
    # a run whose records are incomplete trained to the end: report what was recorded, and exit as the run did
    reported = run_report(argparse.Namespace(run_dir=args.out, out=None, metrics=None))
    return RECORDS_INCOMPLETE_EXIT if incomplete else reported


# ---------------------------------------------------------------------------------------------------
# demo: a clean run and an attention-fault run, the alert timeline, a lead-time report
# ---------------------------------------------------------------------------------------------------
def _add_demo(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="runs/demo",
                   help="demo directory (clean/, one folder per fault, demo.md, demo*.png)")
    p.add_argument("--steps", type=int, default=500, help="training steps of each run (--train-iters)")
    p.add_argument("--fault-start", type=int, default=260,
                   help="after the detectors' 250-step baseline; early enough for the attention fault's max logit to "
                        "explode within 500 steps")
    p.add_argument("--seed", type=int, default=21,
                   help="seed of the runs (default 21: a seed no detector setting was chosen on; "
                        "docs/results/calibration.md)")
    p.add_argument("--faults", nargs="+", default=["attention", "router"], choices=("attention", "router"),
                   help="fault runs after the clean run (attention: a precision fault in layer 1; router: a shift of "
                        "the routers' input that collapses routing onto half of the experts)")
    p.add_argument("--quick", action="store_true",
                   help="a ~2-minute smoke version (120 steps, short detector baseline) for CI")


def _run_demo(args: argparse.Namespace) -> int:
    from megatron_mech.adapters.path_packages import ENTRY_POINT, missing_packages

    steps, start = (120, 60) if args.quick else (args.steps, args.fault_start)
    error = missing_packages(ENTRY_POINT) or _check_counts(steps=steps)
    if error is None and start >= steps:
        error = (f"--fault-start {start} is not before --steps {steps}: the fault runs would inject nothing "
                 f"(raise --steps or lower --fault-start; the detectors need ~250 steps of baseline first)")
    if error:
        print(f"megatron-mech demo: error: {error}", file=sys.stderr)
        return 2
    from megatron_mech.studies.demo import run_demo

    return run_demo(args)


from megatron_mech.records.report import add_report_arguments, missing_plot_package, run_report  # noqa: E402  (cheap)


# ---------------------------------------------------------------------------------------------------
# patch: the Megatron-LM patch set
# ---------------------------------------------------------------------------------------------------
def _add_patch(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=("check", "apply", "revert"),
                   help="check: report each patch's state (applied / clean / conflict, by file and hunk); "
                        "apply / revert: idempotent, all-or-nothing")
    p.add_argument("megatron_lm_dir", metavar="MEGATRON_LM_DIR", help="root of the Megatron-LM tree (fork)")
    p.add_argument("--series", default=None,
                   help="series to use, e.g. core_v0.17.1 (default: from megatron/core/package_info.py)")
    p.add_argument("--patches-dir", default=None,
                   help="where the core_v* series live (default: $MEGATRON_MECH_PATCHES, else the series "
                        "shipped inside the package, megatron_mech/adapters/megatron_lm_fork/patches)")


def _run_patch(args: argparse.Namespace) -> int:
    from megatron_mech.adapters.megatron_lm_fork import patcher

    action = {"check": patcher.check, "apply": patcher.apply, "revert": patcher.revert}[args.action]
    try:
        report = action(args.megatron_lm_dir, args.patches_dir, args.series)
    except patcher.PatchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("\n".join(report.lines()))
    from megatron_mech.adapters.path_packages import MEGATRON_LM_FORK, missing_packages

    missing = missing_packages(MEGATRON_LM_FORK)  # the fork's own launcher would stop at the first of them
    if missing and args.action != "revert":
        print(f"warning: {missing}", file=sys.stderr)
    if args.action == "check":
        return 1 if report.state == patcher.CONFLICT else 0
    return 0


# ---------------------------------------------------------------------------------------------------
# metrics: the metrics reference (docs/metrics.md)
# ---------------------------------------------------------------------------------------------------
def _add_metrics(p: argparse.ArgumentParser) -> None:
    p.add_argument("--output", default=None, metavar="PATH",
                   help="write the reference (Markdown) to PATH instead of stdout, e.g. docs/metrics.md")


def _run_metrics(args: argparse.Namespace) -> int:
    from megatron_mech.records.metrics_reference import render_markdown

    text = render_markdown()
    if args.output is None:
        sys.stdout.write(text)
        return 0
    try:
        write_file_atomically(args.output, text)  # never through a link
    except ValueError as e:
        print(f"megatron-mech metrics: error: --output {args.output}: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"megatron-mech metrics: error: --output {args.output}: {e.strerror or e}", file=sys.stderr)
        return 2
    return 0


SUBCOMMANDS: Dict[str, Subcommand] = {
    "prepare-data": Subcommand("build (or find) the embedded Shakespeare + KJV corpus as Megatron .bin/.idx",
                               _add_prepare_data, _run_prepare_data),
    "patch": Subcommand("check, apply or revert the Megatron-LM patch set on a fork (MEGATRON_LM_DIR)",
                        _add_patch, _run_patch),
    "demo": Subcommand("a clean and an attention-fault run of a small MoE GPT: alert timeline, lead time, plot",
                       _add_demo, _run_demo),
    "train": Subcommand("train the small MoE GPT on this machine with the monitors on, then draw the report",
                        _add_train, _run_train),
    "report": Subcommand("plot a run's mech.jsonl (monitor series vs loss, alerts) and summarize it",
                         add_report_arguments, run_report),
    "metrics": Subcommand("print (or --output) the reference of every recorded metric: meaning, unit, producer, "
                          "alert rule", _add_metrics, _run_metrics),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megatron-mech",
        description="megatron-mech: training-instability monitors and MoLS for megatron-core and Megatron-LM")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, cmd in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=cmd.help, description=cmd.help)
        cmd.add_arguments(p)
        p.set_defaults(_run=cmd.run, _parser=p)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        command = args._parser  # the subcommand's own usage and options, not the top level's
        own = [flag for flag in command._option_string_actions if flag.startswith("--")]
        hints = [f"{u.split('=', 1)[0]}: did you mean {closest}?" for u in unknown
                 if u.startswith("--") and (closest := closest_name(u.split("=", 1)[0], own))]
        hint = f" ({'; '.join(hints)})" if hints else ""
        if args.command == "train" and any(u.startswith("--") for u in unknown):
            hint += ("; training flags go after '--', e.g. megatron-mech train --steps 100 -- --mech-interval 5 "
                     "(all of them: python -m megatron_mech.trainers.megatron_core.pretrain_gpt --help)")
        command.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
