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


def write_results(name: str, markdown_body: str, data: dict) -> Path:
    """Write ``results/<name>.md`` (human) and ``results/<name>.json`` (machine) with command and machine."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    command = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0])] + sys.argv[1:])
    header = {"command": command, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": machine()}
    md = [f"# {name}", "", f"Command: `{command}`  ", f"Date: {header['date']}  ",
          "Machine: " + ", ".join(f"{k}={v}" for k, v in header["machine"].items()), "", markdown_body, ""]
    path = RESULTS_DIR / f"{name}.md"
    path.write_text("\n".join(md))
    (RESULTS_DIR / f"{name}.json").write_text(json.dumps({**header, **data}, indent=2))
    return path
