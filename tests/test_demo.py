"""`megatron-mech demo --quick`: the CI smoke version of the demo (docs/guides/entry-point.md), end to end, run by the command installed
from the wheel (tests/installed_package.py) in a directory outside the checkout — so it also proves that the demo
needs nothing but the installed package and its dependencies."""
import subprocess


def test_demo_quick_writes_report_with_attention_attribution(installed_package, tmp_path):
    demo = tmp_path / "demo"
    env = installed_package.env({"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})
    out = subprocess.run([str(installed_package.command), "demo", "--quick", "--out", str(demo)],
                         env=env, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
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
