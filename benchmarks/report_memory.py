"""Wall time and peak memory of ``megatron-mech report`` on large logs: the streaming report of this tree against
the report that read the whole log at once (the package as of another source tree, ``--old-tree``).

A synthetic ``mech.jsonl`` of ``--lines`` records is written with the shape of a real record: the records of
``--template`` (a real run's ``mech.jsonl``; default: the MoE clean-corpus run, whose records hold only the series
a detector may judge) are cycled, their metrics jittered by ±5% so the series vary, with a falling loss, every
step numbered afresh and an alert every 10,000 records. Each report runs in a fresh subprocess
(``python -m megatron_mech.cli report LOG --out-dir ...``) started from a fresh measuring process, so
``resource.getrusage(RUSAGE_CHILDREN).ru_maxrss`` is that report's own peak resident memory.

    python benchmarks/report_memory.py --template RUN/mech.jsonl --lines 20000 100000 \\
        --old-tree /tmp/old_tree --old-max-lines 20000 --record

``--old-tree``: a source tree of the package whose report loads the whole log (e.g. ``git archive <commit> | tar -x
-C /tmp/old_tree``); timed only up to ``--old-max-lines`` lines (it needs several times the file's size in memory).
Generation is not timed. The machine's load is recorded with the figures (timings on a shared machine are only
indicative; the memory figures are not affected by load).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_mech.records.sinks import encode_record, make_record, read_jsonl  # noqa: E402

try:
    from _results import write_results
except ImportError:  # run as a module
    from benchmarks._results import write_results

log = logging.getLogger("report_memory")
CORPUS = REPO / "benchmarks" / "data" / "clean_corpus" / "moe_h64_s21.json.gz"
POOL = 64  # distinct jittered records cycled through the log
ALERT_EVERY = 10_000


def template_records(path: Path | None) -> list[dict]:
    if path is None:
        from megatron_mech.studies import clean_corpus

        return clean_corpus.records(clean_corpus.read(CORPUS))
    return read_jsonl(path)


def write_log(path: Path, lines: int, template: list[dict], seed: int = 0) -> int:
    """A synthetic log of ``lines`` records shaped like ``template`` (module docstring); returns its size in bytes."""
    rng = random.Random(seed)
    pool = []
    for i in range(POOL):
        rec = template[(i * 7) % len(template)]
        metrics = {k: (v * (1 + rng.uniform(-0.05, 0.05)) if isinstance(v, float) else v)
                   for k, v in (rec.get("metrics") or {}).items()}
        pool.append({k: v for k, v in rec.items() if k not in ("step", "loss", "alerts", "metrics")} | {
            "metrics": metrics})
    interval = 5
    with open(path, "w") as f:
        for i in range(lines):
            step = (i + 1) * interval
            base = pool[i % POOL]
            loss = 3.0 + 5.0 / (1 + i / 1000) + rng.gauss(0, 0.02)
            alerts = []
            if i % ALERT_EVERY == ALERT_EVERY - 1:
                alerts = [{"metric": "attn/layer1/head2/delta2_entropy", "family": "attention", "step": step,
                           "value": 0.005, "baseline": 0.3, "score": 9.0, "detail": {"layer": 1, "head": 2}}]
            scalars = {"loss": loss, "lr": base.get("lr"), "grad_norm": base.get("grad_norm")}
            extra = {k: v for k, v in base.items() if k not in ("metrics", "lr", "grad_norm")}
            f.write(encode_record(make_record(step, scalars, base["metrics"], alerts, extra=extra)) + "\n")
    return path.stat().st_size


def measure(tree: Path, log_path: Path, out_dir: Path, timeout: float) -> dict:
    """Run the report of ``tree`` on ``log_path`` from a fresh measuring process; its wall time, peak RSS, rc."""
    probe = (
        "import json, resource, subprocess, sys, time\n"
        "t = time.perf_counter()\n"
        "p = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
        "wall = time.perf_counter() - t\n"
        "print(json.dumps({'wall_s': wall, 'peak_rss_mb': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss"
        " / 1024, 'rc': p.returncode, 'stderr': p.stderr[-2000:]}))\n")
    env = dict(os.environ, PYTHONPATH=str(tree))
    cmd = [sys.executable, "-c", probe, sys.executable, "-m", "megatron_mech.cli", "report", str(log_path),
           "--out-dir", str(out_dir)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=tree)
    if done.returncode != 0:
        raise RuntimeError(f"measuring process failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--template", type=Path, default=None, help="a real run's mech.jsonl to copy records from")
    parser.add_argument("--lines", type=int, nargs="+", default=[20_000, 100_000])
    parser.add_argument("--old-tree", type=Path, default=None, help="source tree of the whole-log report")
    parser.add_argument("--old-max-lines", type=int, default=20_000)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per report")
    parser.add_argument("--record", action="store_true", help="write results/report_memory.{md,json}")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    template = template_records(args.template)
    load_start = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory(prefix="report_memory_") as tmp:
        for lines in args.lines:
            log_path = Path(tmp) / f"log_{lines}" / "mech.jsonl"
            log_path.parent.mkdir()
            size = write_log(log_path, lines, template)
            log.info("%d lines, %.0f MB written", lines, size / 1e6)
            trees = [("streaming (this tree)", REPO)]
            if args.old_tree is not None and lines <= args.old_max_lines:
                trees.append(("whole log (--old-tree)", args.old_tree))
            for label, tree in trees:
                result = measure(tree, log_path, Path(tmp) / "out", args.timeout)
                if result["rc"] != 0:
                    raise RuntimeError(f"{label} report failed on {lines} lines: {result['stderr']}")
                log.info("  %s: %.1f s, peak RSS %.0f MB", label, result["wall_s"], result["peak_rss_mb"])
                rows.append({"lines": lines, "mb": size / 1e6, "report": label, "wall_s": result["wall_s"],
                             "peak_rss_mb": result["peak_rss_mb"], "load1": os.getloadavg()[0]})
            log_path.unlink()
    metrics_per_record = len(template[0].get("metrics") or {})
    body = [f"Machine load (1-minute average) at start: {load_start[0]:.2f} on {os.cpu_count()} cores; the load at "
            "the end of each report is in its row. Timings on a shared machine are indicative; peak memory is not "
            "affected by the load.", "",
            f"Synthetic logs shaped like {'the MoE clean-corpus run' if args.template is None else args.template.name}"
            f" ({metrics_per_record} metrics a record), one alert every {ALERT_EVERY:,} records. Each report in a "
            "fresh process: `python -m megatron_mech.cli report LOG --out-dir DIR`; peak RSS from "
            "`getrusage(RUSAGE_CHILDREN).ru_maxrss` of a fresh measuring process.", "",
            "| lines | log MB | report | wall s | peak RSS MB | load at end |", "|---:|---:|---|---:|---:|---:|"]
    body += [f"| {r['lines']:,} | {r['mb']:.0f} | {r['report']} | {r['wall_s']:.1f} | {r['peak_rss_mb']:.0f} | "
             f"{r['load1']:.2f} |" for r in rows]
    text = "\n".join(body)
    print(text)
    if args.record:
        path = write_results("report_memory", text, {"rows": rows, "load_start": load_start[0],
                                                     "metrics_per_record": metrics_per_record})
        log.info("wrote %s", path)


if __name__ == "__main__":
    main()
