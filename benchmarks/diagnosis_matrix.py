"""The diagnosis confusion matrix: for each true regime, the cause the run's first alert named.

Rows are the regimes of :data:`REGIMES` (clean; the demo's attention-precision fault and a slower variant; the
router fault; the LR too high from the start; an LR warm-up too steep; an LR raised mid-run; a stretch of corrupted
data; skipped optimizer steps), each trained on two paths: megatron-core (our entry point, the demo's small MoE GPT,
EP=2 on 2 CPU processes) and DeepSpeed (the launcher's Mixtral-style HF model, ZeRO-2, 2 processes; bf16 where the
regime needs it, fp32 elsewhere: bf16 on CPU runs ~4× slower). Columns
are the diagnosis of the run's first alert (:func:`megatron_mech.core.diagnosis.first_diagnosis`), or "no alert":
the run's records replayed in order through today's default detectors (:func:`replayed_alerts`, so a rule fixed on
the tuning seeds re-scores kept runs without training them again; the hook's skipped-steps alerts are taken as
recorded), beside the diagnosis the run itself recorded when it trained (``live``; the two agree for a run trained
with today's rules, which the report checks). Every run's first alert step is set against each incumbent rule's
first firing from the regime's onset (:mod:`megatron_mech.studies.incumbents`).

Each scored run is kept as one small row, ``benchmarks/results/diagnosis_matrix/<path>_<regime>_s<seed>.json``
(committed), so the matrix grows across sessions: a run whose row exists is not trained again (``--retrain`` to
redo it). The report reads every row there; tuning seeds and reporting seeds go to separate pages, and only the
reporting page is a result.

    python benchmarks/diagnosis_matrix.py --tuning-run --seeds 11 --paths megatron deepspeed \
        --results-name diagnosis_matrix_tuning                 # fix the regimes' strengths and the rules on these
    python benchmarks/diagnosis_matrix.py --seeds 21 22 --paths deepspeed      # reporting seeds, a few at a time
    python benchmarks/diagnosis_matrix.py --score-only                           # rewrite the pages from the rows
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks._results import write_results  # noqa: E402
from benchmarks.midrun_lr import train  # noqa: E402
from megatron_mech.core.diagnosis import CAUSES, first_diagnosis  # noqa: E402
from megatron_mech.core.layer_names import layer_of  # noqa: E402
from megatron_mech.monitors.metric_names import SYMPTOM_SKIPPED_STEPS  # noqa: E402
from megatron_mech.monitors.registry import default_registry  # noqa: E402
from megatron_mech.records.jsonl_file import read_jsonl, record_alerts  # noqa: E402
from megatron_mech.records.run_summary import read_run_summary  # noqa: E402
from megatron_mech.studies.incumbents import firing_steps, microbatches_per_rank, run_incumbent_firings  # noqa: E402
from megatron_mech.studies.leadtime import LEAD_MODEL, TUNING_SEEDS  # noqa: E402

ROWS = REPO / "benchmarks" / "results" / "diagnosis_matrix"
MATRIX_REPORTING_SEEDS = tuple(range(21, 31))  # ten: "more than one reporting seed in ten" needs ten per cell
NO_ALERT = "no alert"
PATHS = ("megatron", "deepspeed")


@dataclass(frozen=True)
class Regime:
    """One true regime: the cause a right diagnosis names (None: no alert), its onset (the incumbents are counted
    from it), the run's length, and its fault on each path (``--mech-fault*`` flags; the DeepSpeed config's
    ``mech.fault``), plus flags that change the run itself (LR, warm-up, precision)."""

    expected: Optional[str]
    onset: int
    steps: int
    fault: dict
    megatron_extra: tuple = ()
    deepspeed_extra: tuple = ()
    megatron_steps: Optional[int] = None  # a path that needs another length (fp16 on CPU runs ~4× slower)
    deepspeed_bf16: bool = False  # bf16 on CPU runs ~4× slower than fp32: only where the regime needs it


ATTENTION = {"kind": "attention", "strength": 0.3, "layers": [1], "ramp": 100, "start": 260}
REGIMES = {
    "clean": Regime(None, 1, 500, {}),
    "attention": Regime("precision", 260, 500, ATTENTION),
    "attention_slow": Regime("precision", 260, 500, {**ATTENTION, "ramp": 200}),
    "router": Regime("router", 260, 500, {"kind": "router_input", "strength": 10.0, "ramp": 100, "start": 260}),
    # the LR × 30 from the start (megatron 0.06, DeepSpeed 0.09), with each path's usual warm-up
    "lr_high": Regime("learning_rate", 1, 300, {"kind": "lr", "strength": 30.0, "start": 0}),
    # the LR × 10 reached in one step instead of the usual warm-up
    "warmup_steep": Regime("learning_rate", 1, 300, {"kind": "lr", "strength": 10.0, "start": 0},
                           megatron_extra=("--lr-warmup-iters", "1"), deepspeed_extra=("--warmup", "1")),
    "lr_midrun": Regime("learning_rate", 300, 500, {"kind": "lr", "strength": 100.0, "ramp": 100, "start": 300}),
    "data": Regime("data", 300, 500, {"kind": "data", "start": 300, "steps": 20}),
    # megatron-core skips a step only with a loss scaler (fp16); DeepSpeed's bf16 optimizer skips it silently
    "skipped": Regime("optimizer_skipped", 150, 300, {"kind": "skip", "start": 150, "steps": 10},
                      megatron_extra=("--fp16",), megatron_steps=200, deepspeed_bf16=True),
}
DEEPSPEED_MODEL = ["--model", "mixtral", "--layers", "4", "--hidden", "64", "--heads", "4", "--kv-heads", "2",
                   "--experts", "4", "--micro-batch", "4", "--seq-len", "64", "--lr", "3e-3", "--warmup", "10"]


def _flags(fault: dict) -> list:
    out = []
    for key, value in fault.items():
        out += [f"--mech-fault-{key}" if key != "kind" else "--mech-fault",
                *([str(v) for v in value] if isinstance(value, list) else [f"{value:g}" if isinstance(value, float)
                                                                            else str(value)])]
    return out


def megatron_command(regime: Regime, seed: int, run_dir: Path) -> list:
    from megatron_mech.studies.pretrain_gpt_fault import ENTRY_MODULE
    from megatron_mech.trainers.megatron_core.launch import torchrun_prefix
    from megatron_mech.trainers.megatron_core.presets import fit_lr_warmup

    steps = regime.megatron_steps or regime.steps
    # the regime's own flags come last: for a flag the preset also sets, the last one given wins
    return [*torchrun_prefix(2), "-m", ENTRY_MODULE, *fit_lr_warmup(LEAD_MODEL, steps), "--seed", str(seed),
            "--train-iters", str(steps), "--save", str(run_dir), "--overwrite-run", "--mech-record-routing",
            str(run_dir), *regime.megatron_extra, *_flags(regime.fault)]


def deepspeed_command(regime: Regime, seed: int, run_dir: Path) -> list:
    from megatron_mech.trainers.megatron_core.launch import torchrun_prefix

    flags = list(DEEPSPEED_MODEL)
    for flag, value in zip(regime.deepspeed_extra[::2], regime.deepspeed_extra[1::2]):
        flags[flags.index(flag) + 1] = value
    config = {"train_micro_batch_size_per_gpu": int(flags[flags.index("--micro-batch") + 1]),
              "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 2}, "steps_per_print": 10 ** 9,
              "gradient_clipping": 1.0, **({"bf16": {"enabled": True}} if regime.deepspeed_bf16 else {}),
              "optimizer": {"type": "AdamW", "params": {"lr": float(flags[flags.index("--lr") + 1]),
                                                        "torch_adam": True}},
              "scheduler": {"type": "WarmupLR", "params": {
                  "warmup_min_lr": 0.0, "warmup_max_lr": float(flags[flags.index("--lr") + 1]),
                  "warmup_num_steps": int(flags[flags.index("--warmup") + 1])}},
              "mech": {"monitors": {"interval": 5}, "output": {"dir": str(run_dir)},
                       **({"fault": regime.fault} if regime.fault else {})}}
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir.parent / f"{run_dir.name}.ds_config.json").write_text(json.dumps(config, indent=1))
    return [*torchrun_prefix(2), "-m", "megatron_mech.studies.deepspeed_fault_train", *flags, "--seed", str(seed),
            "--steps", str(regime.steps), "--output-dir", str(run_dir), "--overwrite-run",
            "--deepspeed-config", str(run_dir.parent / f"{run_dir.name}.ds_config.json")]


COMMANDS = {"megatron": megatron_command, "deepspeed": deepspeed_command}


def _details(metrics: dict) -> dict:
    """The layer (and head) of each series, from its name, as the monitors attach them to their alerts."""
    out = {}
    for name in metrics:
        layer = layer_of(name)
        if layer is not None:
            head = name.split("/head")[1].split("/")[0] if "/head" in name else None
            out[name] = {"layer": layer, **({"head": int(head)} if head and head.isdigit() else {})}
    return out


def replayed_alerts(records: list, overrides: dict) -> list:
    """The alerts today's default detectors (with the run's detector settings, ``overrides``) fire on a run's
    records (``mech.jsonl``, decoded), fed in order as the hook fed them, plus the hook's own skipped-steps alerts as
    recorded (a fact the trainer reported, not a series the detectors judge)."""
    registry, alerts = default_registry(overrides), []
    for record in records:
        metrics = {k: float(v) for k, v in (record.get("metrics") or {}).items() if isinstance(v, (int, float))}
        alerts += registry.update(int(record["step"]), metrics, _details(metrics))
        alerts += [a for a in record_alerts(record) if a.metric == SYMPTOM_SKIPPED_STEPS]
    return alerts


def score(path: str, name: str, seed: int, run_dir: Path, cmd: list) -> dict:
    """One run's row: the first alert's step, cause, layers and signals (replayed with today's rules, and as the
    run recorded it), and each incumbent's first firing from the regime's onset."""
    regime = REGIMES[name]
    summary = read_run_summary(run_dir / "summary.json")
    records = read_jsonl(run_dir / "mech.jsonl")
    alerts = replayed_alerts(records, summary.detectors.get("rule_overrides") or {})
    first = first_diagnosis(alerts)
    expected = next((a.step for a in alerts if a.detail.get("cause") == regime.expected), None)
    live = first_diagnosis([a for r in records for a in record_alerts(r)])
    micro = microbatches_per_rank(cmd, 2) if path == "megatron" else 1

    def firings(from_step: int) -> dict:
        return run_incumbent_firings(records, [float(v) for v in summary.losses], microbatches=micro,
                                     grad_norms=summary.grad_norms, from_step=from_step)

    incumbents = firings(regime.onset)
    # on the clean run, every firing of each rule: a rule that rings there from a regime's onset is not counted
    every = {rule: firing_steps(firings, rule, 1) for rule in incumbents} if name == "clean" else None
    return {"path": path, "regime": name, "seed": seed, "expected": regime.expected or NO_ALERT,
            "diagnosis": first.cause if first else NO_ALERT, "first_alert": first.to_dict() if first else None,
            "live": {"diagnosis": live.cause, "step": live.step} if live else {"diagnosis": NO_ALERT},
            "expected_cause_step": expected, **({"incumbent_firings": every} if every is not None else {}),
            "onset": regime.onset, "steps": len(summary.losses), "incumbents": incumbents,
            "final_loss": float(summary.losses[-1]) if summary.losses else None,
            "command": "torchrun --nproc_per_node=2 " + " ".join(cmd[len(cmd) - 1 - cmd[::-1].index("-m"):]),
            **({"deepspeed_config": json.loads(Path(cmd[-1]).read_text())} if path == "deepspeed" else {})}


def row_path(path: str, name: str, seed: int) -> Path:
    return ROWS / f"{path}_{name}_s{seed}.json"


def load_rows() -> list:
    return [json.loads(p.read_text()) for p in sorted(ROWS.glob("*.json"))]


def confusion(rows: list) -> dict:
    """``{regime: {diagnosis: [seeds]}}`` of the rows (one path, one kind of seed)."""
    table = {}
    for row in rows:
        table.setdefault(row["regime"], {}).setdefault(row["diagnosis"], []).append(row["seed"])
    return table


def _lead(row: dict, clean: Optional[dict]) -> str:
    """The first alert's step against each incumbent's first firing from the onset; a rule that also rang on the
    same seed's clean run from the onset is marked, not counted (the standard the monitors meet)."""
    rings = {rule for rule, steps in ((clean or {}).get("incumbent_firings") or {}).items()
             if any(s >= row["onset"] for s in steps)}
    fired = sorted(((step, rule) for rule, step in row["incumbents"].items() if step is not None))
    words = [f"{rule} {step}" + (" (rings on the clean run)" if rule in rings else "") for step, rule in fired]
    first = row["first_alert"]
    if first is None:
        return "no alert; incumbents: " + (", ".join(words) or "none")
    counted = [step for step, rule in fired if rule not in rings]
    verdict = ("before every counted incumbent" if not counted or first["step"] < min(counted) else
               "tied with the first counted incumbent" if first["step"] == min(counted) else
               f"{first['step'] - min(counted)} steps after the first counted incumbent")
    later = (f"; the expected cause first at {row['expected_cause_step']}"
             if row.get("expected_cause_step") not in (None, first["step"]) else "")
    return (f"first alert {first['step']} ({row['diagnosis']}{later}), {verdict}; incumbents: "
            + (", ".join(words) or "none"))


def report(rows: list, tuning: bool, seeds_note: str) -> str:
    columns = [*CAUSES, NO_ALERT]
    lines = [("**TUNING RUN: the regimes' strengths and the rules were fixed on these seeds; not a result.** "
              if tuning else "") + seeds_note, "",
             "Rows: the true regime (its expected diagnosis). Columns: the diagnosis of the run's first alert, its "
             "records replayed through today's rules. A cell counts runs and names their seeds; the diagonal (bold) "
             "is the expected column.",
             ""]
    for path in PATHS:
        mine = [r for r in rows if r["path"] == path]
        if not mine:
            continue
        table = confusion(mine)
        used = [c for c in columns if any(c in cells for cells in table.values())]
        lines += [f"## {path}", "", "| regime (expected) | " + " | ".join(used) + " |",
                  "|---|" + "---|" * len(used)]
        for name in REGIMES:
            if name not in table:
                continue
            expected = REGIMES[name].expected or NO_ALERT
            cells = []
            for column in used:
                seeds = sorted(table[name].get(column, []))
                text = f"{len(seeds)} (s{', s'.join(map(str, seeds))})" if seeds else "·"
                cells.append(f"**{text}**" if column == expected and seeds else text)
            lines.append(f"| {name} ({expected}) | " + " | ".join(cells) + " |")
        right = sum(r["diagnosis"] == r["expected"] for r in mine)
        differ = [f"{r['regime']} s{r['seed']} (live {r['live']['diagnosis']})" for r in mine
                  if r["live"]["diagnosis"] != r["diagnosis"]]
        lines += ["", f"Diagonal: {right} of {len(mine)} runs. Runs whose live diagnosis (as trained) differs from "
                  f"today's rules replayed: " + (", ".join(differ) if differ else "none") + ".", "",
                  "First alert step against the incumbents "
                  "(each counted from the regime's onset):", ""]
        clean = {r["seed"]: r for r in mine if r["regime"] == "clean"}
        order = sorted(mine, key=lambda r: (list(REGIMES).index(r["regime"]), r["seed"]))
        lines += [f"- {r['regime']} s{r['seed']}: {_lead(r, clean.get(r['seed']))}" for r in order]
        lines.append("")
    lines += ["## Commands", "", f"Seed {rows[0]['seed']}'s (the DeepSpeed runs' configs, with their `mech.fault`, are "
              "in their rows):", ""]
    lines += sorted({f"- {r['path']} {r['regime']}: `{r['command']}`" for r in rows
                     if r["seed"] == rows[0]["seed"] and "command" in r})
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[])
    p.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    p.add_argument("--regimes", nargs="+", choices=list(REGIMES), default=list(REGIMES))
    p.add_argument("--runs-dir", default=str(REPO / "runs" / "diagnosis_matrix"))
    p.add_argument("--retrain", action="store_true", help="train runs whose row exists again")
    p.add_argument("--keep-runs", action="store_true", help="keep each run's directory after scoring")
    p.add_argument("--score-only", action="store_true", help="train nothing; write the pages from the rows")
    p.add_argument("--rescore", action="store_true",
                   help="score again, with today's rules, every kept run under --runs-dir that has a row")
    p.add_argument("--tuning-run", action="store_true", help="allow tuning seeds (their page says so)")
    p.add_argument("--results-name", default="diagnosis_matrix")
    args = p.parse_args(argv)
    if any(s in TUNING_SEEDS for s in args.seeds) and not args.tuning_run:
        p.error(f"seeds {TUNING_SEEDS} are tuning seeds: pass --tuning-run (the page says so)")
    ROWS.mkdir(parents=True, exist_ok=True)
    for seed in [] if args.score_only else args.seeds:
        for path in args.paths:
            for name in args.regimes:
                out = row_path(path, name, seed)
                if out.exists() and not args.retrain:
                    continue
                run_dir = Path(args.runs_dir) / path / f"s{seed}" / name
                cmd = COMMANDS[path](REGIMES[name], seed, run_dir)
                train(cmd, run_dir, reuse=False)
                out.write_text(json.dumps(score(path, name, seed, run_dir, cmd), indent=1, sort_keys=True) + "\n")
                print(f"{path} {name} s{seed}: {json.loads(out.read_text())['diagnosis']}", flush=True)
                if not args.keep_runs:
                    shutil.rmtree(run_dir, ignore_errors=True)
    for out in sorted(ROWS.glob("*.json")) if args.rescore else ():
        row = json.loads(out.read_text())
        run_dir = Path(args.runs_dir) / row["path"] / f"s{row['seed']}" / row["regime"]
        if (run_dir / "summary.json").exists():
            cmd = COMMANDS[row["path"]](REGIMES[row["regime"]], row["seed"], run_dir)
            out.write_text(json.dumps(score(row["path"], row["regime"], row["seed"], run_dir, cmd), indent=1,
                                      sort_keys=True) + "\n")
    rows = load_rows()
    for tuning, name in ((True, "diagnosis_matrix_tuning"), (False, "diagnosis_matrix")):
        mine = [r for r in rows if (r["seed"] in TUNING_SEEDS) == tuning]
        if not mine:
            continue
        seeds = sorted({r["seed"] for r in mine})
        note = (f"Seeds {seeds} ({'tuning' if tuning else 'reporting'}; tuning seeds {list(TUNING_SEEDS)}, "
                f"reporting seeds {list(MATRIX_REPORTING_SEEDS)}). Rows: {len(mine)} runs of "
                f"`benchmarks/results/diagnosis_matrix/`.")
        text = report(mine, tuning, note)
        print(text)
        write_results(name, text, {"rows": mine})


if __name__ == "__main__":
    main()
