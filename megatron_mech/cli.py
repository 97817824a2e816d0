"""``megatron-mech`` command line (also ``python -m megatron_mech.cli``).

Adding a subcommand: write ``_add_<name>(parser)`` (declare options) and ``_run_<name>(args) -> int``
(import heavy dependencies *inside* it, so ``megatron-mech --help`` stays fast), then register both in
``SUBCOMMANDS`` with a one-line help string.
"""
from __future__ import annotations

import argparse
import sys
from typing import Callable, Dict, List, NamedTuple, Optional


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

    from megatron_mech.data import MissingDataPackageError, prepare_data

    t0 = time.perf_counter()
    try:
        paths = prepare_data(args.out_dir, vocab_size=args.vocab_size, valid_fraction=args.valid_fraction,
                             force=args.force, max_docs_per_source=args.max_docs_per_source, quiet=args.quiet)
    except MissingDataPackageError as e:
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


from megatron_mech.report import add_report_arguments, run_report  # noqa: E402  (cheap: no matplotlib/torch)

SUBCOMMANDS: Dict[str, Subcommand] = {
    "prepare-data": Subcommand("build (or find) the embedded Shakespeare + KJV corpus as Megatron .bin/.idx",
                               _add_prepare_data, _run_prepare_data),
    "report": Subcommand("plot a run's mech.jsonl (monitor series vs loss, alerts) and summarize it",
                         add_report_arguments, run_report),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megatron-mech",
        description="megatron-mech: training-instability monitors and MoLS for Megatron-LM and DeepSpeed")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, cmd in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=cmd.help, description=cmd.help)
        cmd.add_arguments(p)
        p.set_defaults(_run=cmd.run)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
