"""Shared by the benchmarks: describe the machine and write a results file next to the scripts."""
from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import sys
from pathlib import Path

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def machine() -> dict:
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cuda": torch.cuda.is_available(),
    }


def write_results(name: str, markdown_body: str, data: dict, command: str | None = None) -> Path:
    """Write ``results/<name>.md`` (human) and ``results/<name>.json`` (machine) with command and machine
    (``command``: the command that produced the data, when it is not this process's own)."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    if command is None:
        command = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0])] + sys.argv[1:])
    header = {"command": command, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": machine()}
    md = [f"# {name}", "", f"Command: `{command}`  ", f"Date: {header['date']}  ",
          "Machine: " + ", ".join(f"{k}={v}" for k, v in header["machine"].items()), "", markdown_body, ""]
    path = RESULTS_DIR / f"{name}.md"
    path.write_text("\n".join(md))
    (RESULTS_DIR / f"{name}.json").write_text(json.dumps({**header, **data}, indent=2))
    return path


def check_idle(force: bool = False, max_load_per_core: float = 0.3) -> dict:
    """Refuse to time on a loaded machine: the 1-minute load average (``os.getloadavg``) per core must stay
    below ``max_load_per_core``. With ``force`` a loaded machine only warns (the figures are then marked
    ``"loaded": true``). Returns ``{"load1", "cores", "loaded"}`` for the results file."""
    import logging

    load1 = os.getloadavg()[0]
    cores = os.cpu_count() or 1
    loaded = load1 / cores > max_load_per_core
    if loaded:
        message = (f"machine is loaded: 1-minute load average {load1:.2f} on {cores} cores (> {max_load_per_core} "
                   f"per core); timings would measure the other processes")
        if not force:
            raise SystemExit(message + " -- refusing (pass --force to time anyway, marked as loaded)")
        logging.getLogger(__name__).warning(message + " -- timing anyway (--force)")
    return {"load1": load1, "cores": cores, "loaded": loaded}
