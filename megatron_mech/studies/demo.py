"""``megatron-mech demo``: a clean run and fault runs of the small MoE GPT, the alert timeline, the lead time.

Every run is our entry point under ``torchrun`` with ``--mech-on-alert checkpoint``. What the demo reports about a
run comes from its records: the alerts from ``mech.jsonl`` (the run's one record of alerts) and the per-step loss
from ``summary.json``'s ``losses``, indexed by step (``first_step`` is the step of ``losses[0]``).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

__all__ = ["DEMO_FAULTS", "collapse_line", "demo_commands", "demo_length", "run_demo", "step_losses"]


def step_losses(run_dir) -> list:
    """The loss of every step of a fresh run, ``[loss of step 1, loss of step 2, ...]`` (from ``summary.json``)."""
    summary = json.loads((Path(run_dir) / "summary.json").read_text())
    if summary.get("first_step", 1) != 1:
        raise ValueError(f"{run_dir}: the run resumed at step {summary['first_step']}; the demo needs fresh runs")
    return summary["losses"]


def _progress_line(line: str) -> bool:
    return line.startswith(("[train]", "[mech]", "[fault]", "[eval]"))


def demo_length(args: argparse.Namespace) -> tuple:
    """``(steps, fault start)`` of every demo run: 120 and 60 with ``--quick``, else the flags'."""
    return (120, 60) if args.quick else (args.steps, args.fault_start)


def demo_commands(args: argparse.Namespace) -> dict:
    """The torchrun command of each demo run (``clean`` first, then the faults), by run name. The preset's LR
    warm-up is shortened to fit a short demo (:func:`megatron_mech.megatron.presets.fit_lr_warmup`)."""
    from megatron_mech.megatron.launch import torchrun_prefix
    from megatron_mech.megatron.presets import fit_lr_warmup
    from megatron_mech.studies.leadtime import FAULT_FLAGS, LEAD_MODEL
    from megatron_mech.studies.pretrain_gpt_fault import ENTRY_MODULE

    steps, start = demo_length(args)
    faults = ["attention"] if args.quick else list(dict.fromkeys(args.faults))
    detector = (["--mech-detector-warmup", "4", "--mech-detector-baseline", "6"] if args.quick else [])
    commands = {}
    for name in ["clean", *faults]:
        fault = [*FAULT_FLAGS[name], "--mech-fault-start", str(start)] if name != "clean" else []
        run_dir = Path(args.out) / name
        commands[name] = [*torchrun_prefix(2), "-m", ENTRY_MODULE,
                          *fit_lr_warmup(LEAD_MODEL, steps), "--seed", str(args.seed), "--train-iters", str(steps),
                          "--save", str(run_dir), "--tensorboard-dir", str(run_dir / "tb"),
                          "--mech-on-alert", "checkpoint", "--overwrite-run", *detector, *fault,  # it owns its folders
                          "--mech-record-routing", str(run_dir)]
    return commands


DEMO_FAULTS = {
    "attention": ("attention-precision fault", "the biased bf16-rounding mechanism of FlashAttention's backward "
                  "injected into layer 1"),
    "router": ("router fault (a massive activation at the routers)", "a vector shared by every token added to each "
               "MoE router's input, aligned so that it adds β to the logits of half of the experts, β growing from 0 "
               "to {strength} over {ramp} steps (the experts still get the true tokens; no load-balancing loss holds "
               "the routing)"),
}
"""The demo's fault runs: ``(title, what was injected)``, formatted with the fault's ``--mech-fault-*`` values."""


def _fault_text(name: str) -> tuple:
    from megatron_mech.studies.leadtime import FAULT_FLAGS

    flags = FAULT_FLAGS[name]
    values = {flag[len("--mech-fault-"):]: value for flag, value in zip(flags, flags[1:]) if flag.startswith("--")}
    return tuple(text.format(**values) for text in DEMO_FAULTS[name])


def collapse_line(run_dir) -> str:
    """What the routing record says: the step routing collapsed (by
    :func:`~megatron_mech.studies.router_outcome.find_collapse`), or that it did not."""
    from megatron_mech.studies.router_outcome import STARVED_HOLD, STARVED_SHARE, find_collapse, read_routing_counts

    collapse = find_collapse(read_routing_counts(run_dir))
    level = (f"an expert gets < {STARVED_SHARE:.0%} of its layer's top-k assignments for {STARVED_HOLD} "
             f"consecutive steps, counted on the routers' own decisions, apart from the monitors")
    if collapse is None:
        return f"routing did not collapse within the run ({level})"
    return (f"routing collapsed at step {collapse.step} (known at step {collapse.step + STARVED_HOLD - 1}): expert "
            f"{collapse.expert} of layer {collapse.layer} starved ({level})")


def run_demo(args: argparse.Namespace) -> int:
    """``megatron-mech demo``: see the module docstring."""
    import os

    from megatron_mech.megatron.launch import run_training
    from megatron_mech.core.attribution import alert_lines
    from megatron_mech.records.report import run_report
    from megatron_mech.records.sinks import read_alerts, read_jsonl
    from megatron_mech.studies.leadtime import divergence_step, first_alert, plot_fault
    from megatron_mech.studies.pretrain_gpt_fault import check_flags

    steps, start = demo_length(args)
    commands = demo_commands(args)
    faults = [name for name in commands if name != "clean"]
    for name, cmd in commands.items():  # every run's flags, before the first one starts
        error = check_flags(cmd, 2)
        if error:
            print(f"megatron-mech demo: error: the {name} run's flags: {error}", file=sys.stderr)
            return 2
    out = Path(args.out)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    runs = {}
    for name, cmd in commands.items():
        run_dir = out / name
        what = f", {_fault_text(name)[0]} from step {start}" if name != "clean" else ""
        print(f"== {name} run ({steps} steps{what}) ==", flush=True)
        code, _ = run_training(cmd, env, show=_progress_line, prefix=f"[{name}] ")
        if code:
            print(f"error: the {name} run failed", file=sys.stderr)
            return 1
        runs[name] = {"losses": step_losses(run_dir), "alerts": read_alerts(run_dir / "mech.jsonl"),
                      "records": read_jsonl(run_dir / "mech.jsonl"), "seed": args.seed}
        run_report(argparse.Namespace(run_dir=str(run_dir), out=None, metrics=None))

    clean = runs["clean"]
    lines = ["# megatron-mech demo: faults caught before the loss moves", "",
             f"Runs of the small MoE GPT (seed {args.seed}, {steps} steps), identical except for one injected fault "
             f"from step {start}. Loss divergence: the 20-step moving-average loss stays > 0.2 nats above the "
             f"clean run until the end.", "",
             f"- clean run: {len(clean['alerts'])} alerts (false alarms)"]
    for name in faults:
        faulty = runs[name]
        divergence = divergence_step(faulty["losses"], clean["losses"], 0.2)
        firsts = {f: first_alert(faulty["alerts"], f) for f in ("attention", "router", "symptom")}
        plot = "demo.png" if name == "attention" else f"demo_{name}.png"
        plot_fault(out / plot, name, clean, faulty, start, divergence, firsts)
        title, what = _fault_text(name)
        lines += ["", f"## {title}", "", f"Fault: {what}, from step {start}.", "",
                  f"- first attention alert: {firsts['attention'] or 'none'}; first router alert: "
                  f"{firsts['router'] or 'none'}; first symptom (loss/grad-norm) alert — what you have today: "
                  f"{firsts['symptom'] or 'none'}; loss divergence: {divergence or 'not within the run'}"]
        if name == "router":
            lines.append(f"- {collapse_line(out / name)}")
        first = min((s for s in (firsts["attention"], firsts["router"]) if s), default=None)
        if first and firsts["symptom"]:
            lines.append(f"- **the monitors fired {firsts['symptom'] - first} steps before the loss/grad-norm "
                         f"alarm**")
        elif first:
            lines.append("- **the monitors fired; the loss/grad-norm alarm never did**")
        if divergence and first:
            lines.append(f"- **lead time of the monitors: {divergence - first} steps** "
                         f"({100 * (first - start) / max(1, divergence - start):.0f}% of the way from fault onset "
                         f"to divergence)")
        lines += ["", "Alert timeline:", ""]
        lines += [f"- {line}" for line in alert_lines(faulty["alerts"])] or ["- no alerts"]
        lines += ["", f"![monitors vs loss]({plot})"]
    lines += ["", "Per-run reports: " + ", ".join(f"`{n}/report.md`" for n in runs) + ". Each fault run saved a "
              "checkpoint at its first alert (`<run>/first_alert.json` names it)."]
    (out / "demo.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"\nreport: {out / 'demo.md'}\nplots:  " + ", ".join(str(p) for p in sorted(out.glob("demo*.png"))))
    return 0
