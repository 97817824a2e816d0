"""`megatron-mech demo --quick`: the CI smoke version of the README's demo, end to end."""
import os
import subprocess
import sys

from dist_utils import REPO_ROOT


def test_demo_quick_writes_report_with_attention_attribution(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT), CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, "-m", "megatron_mech.cli", "demo", "--quick", "--out", str(tmp_path)],
                         env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    report = (tmp_path / "demo.md").read_text()
    # the fault is injected in layer 1: attribution must name it
    assert "attention-precision fault suspected in layer 1" in report, report
    # the clean run raises no alert, and the fault run's timeline starts with the injected layer
    assert "- clean run: 0 alerts (false alarms)" in report, report
    timeline = report.split("Alert timeline:", 1)[1].strip().splitlines()
    assert timeline[0].startswith("- attention-precision fault suspected in layer 1"), report
    assert (tmp_path / "demo.png").stat().st_size > 10_000
    assert "[attention] [mech] ALERT" in out.stdout  # alerts stream as they happen
    assert (tmp_path / "clean" / "report.png").exists() and (tmp_path / "attention" / "report.png").exists()
