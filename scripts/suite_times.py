"""Seconds per test folder from a pytest ``--junitxml`` file, as the markdown table of docs/testing.md.

    .venv/bin/python -m pytest -q --junitxml=suite.xml
    .venv/bin/python scripts/suite_times.py suite.xml

A test's time is pytest's junit time (set-up + call + tear-down, ``junit_duration_report = total``, the default);
its folder is the path of its file under ``tests/`` (``unit/core``, ``integration/deepspeed``, ``studies``, ...).
Rows follow the folder names; the last row is the total.
"""
from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path


def folder_of(classname: str) -> str:
    """``tests.unit.core.test_detect`` or ``tests.unit.core.test_detect.TestX`` -> ``unit/core``.

    The module is the first dotted part named ``test_*``; the folder is what lies between ``tests`` and it
    (``.`` for a test file directly in ``tests/``).
    """
    parts = classname.split(".")
    if not parts or parts[0] != "tests":
        raise ValueError(f"testcase classname {classname!r} is not under tests/")
    for index, part in enumerate(parts[1:], start=1):
        if part.startswith("test_"):
            return "/".join(parts[1:index]) or "."
    raise ValueError(f"testcase classname {classname!r} names no test_* module")


def times_per_folder(junit_xml: Path) -> dict[str, tuple[int, float]]:
    """Folder -> (number of test cases, seconds), over every ``<testcase>`` of the file (skipped ones count 0 s
    or their set-up time, as pytest writes them)."""
    try:
        root = ET.parse(junit_xml).getroot()
    except (OSError, ET.ParseError) as err:
        raise SystemExit(f"suite_times: cannot read junit xml {junit_xml}: {err}") from None
    cases = list(root.iter("testcase"))
    if not cases:
        raise SystemExit(f"suite_times: {junit_xml} holds no <testcase>: not a pytest --junitxml file?")
    totals: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for case in cases:
        row = totals[folder_of(case.get("classname", ""))]
        row[0] += 1
        row[1] += float(case.get("time", 0.0))
    return {folder: (count, seconds) for folder, (count, seconds) in totals.items()}


def markdown_table(rows: dict[str, tuple[int, float]]) -> str:
    lines = ["| Folder | Tests | Seconds |", "|---|---:|---:|"]
    for folder in sorted(rows):
        count, seconds = rows[folder]
        lines.append(f"| `{folder}` | {count} | {seconds:.1f} |")
    lines.append(f"| **total** | {sum(c for c, _ in rows.values())} | {sum(s for _, s in rows.values()):.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("junit_xml", type=Path, help="the file written by pytest --junitxml")
    args = parser.parse_args(argv)
    print(markdown_table(times_per_folder(args.junit_xml)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
