"""bench_mols' arms, seed rules and report arithmetic (no training: run summaries are built here)."""
import argparse
import json
import math

import pytest

from benchmarks import bench_mols as bm
from megatron_mech.studies.paired import paired_ci


def _args(**kw):
    a = dict(arms=["adamw", "mols"], window=None, diagnostic_interval=50, mols_extra="", grid_values=[0.5, 1.0, 2.0],
             steps=300, hidden=128, layers=4, heads=4, ffn=None, seq=128, micro_batch=4, global_batch=16, lr=1e-3,
             warmup=None, eval_interval=30, eval_iters=8, seeds=[21, 22, 23], tuning_run=False)
    a.update(kw)
    return argparse.Namespace(**a)


def test_grid_arms_are_the_eight_hand_set_settings_and_bad_arms_are_refused():
    arms = bm.expand_arms(_args(arms=["adamw", "grid"]))
    fixed = [k for k in arms if k.startswith("fixed:")]
    assert len(fixed) == 8 and "fixed:embedding=1,head=1,qk=1" not in arms
    flags = arms["fixed:embedding=2,head=2,qk=0.5"]
    i = flags.index("--mech-mols-fixed")
    assert flags[i + 1:i + 4] == ["embedding=2", "head=2", "qk=0.5"]
    with pytest.raises(ValueError, match="--arms fixed:emb=2.*unknown module class"):
        bm.expand_arms(_args(arms=["adamw", "fixed:emb=2"]))
    with pytest.raises(SystemExit, match="must include adamw"):
        bm.expand_arms(_args(arms=["mols"]))


def test_tuning_seeds_are_refused_without_tuning_run(capsys):
    with pytest.raises(SystemExit) as e:
        bm.main(["--seeds", str(bm.TUNING_SEEDS[0]), "--no-write"])
    assert e.value.code == 2 and "tuning seeds" in capsys.readouterr().err


def _summary(seed, final, history, alpha_qk=1.5):
    return {"seed": seed, "final_valid_loss": final, "valid_history": history, "mols_seconds": 0.1,
            "step_seconds": [1.0] * 10, "params_per_rank": 2_900_000,
            "final_mols": {"mols/snr/qk": 0.05, "mols/snr/vo": 0.1, "mols/alpha_raw/qk": alpha_qk,
                           "mols/alpha_raw/vo": 1.0, "mols/mult/qk": min(alpha_qk, 2.0), "mols/mult/vo": 1.0},
            "mols_diagnostics": [{"start": 70, "end": 89, "snr": {"qk": 0.02, "vo": 0.1},
                                  "alpha": {"qk": math.sqrt(5), "vo": 1.0}}]}


def test_report_paired_interval_steps_to_reach_and_clamp_counts():
    a = _args()
    adamw = [_summary(s, f, [[150, f + 0.2], [300, f]]) for s, f in ((21, 5.10), (22, 5.12), (23, 5.08))]
    mols = [_summary(21, 5.05, [[150, 5.09], [300, 5.05]], 2.5), _summary(22, 5.13, [[150, 5.3], [300, 5.13]]),
            _summary(23, 5.07, [[150, 5.2], [300, 5.07]])]
    text, summary = bm.report(a, {"adamw": [], "mols": []}, {("adamw", 1.0): adamw, ("mols", 1.0): mols}, [1.0])
    ci = paired_ci([-0.05, 0.01, -0.01])
    got = summary["mols@1"]
    assert got["paired_diff_mean"] == pytest.approx(ci.mean) and got["ci_low"] == pytest.approx(ci.low)
    assert got["excludes_zero"] is False
    assert got["steps_to_adamw_final"] == [150, None, 300]  # seed 22 never reaches 5.12
    assert "| qk | 1.5 | 1.83 | 2.5 | 0 / 1 |" in text  # one seed's raw α above the clamp
    assert "| diagnostic 1 | 71–90 |" in text


def test_mols_variant_arm_passes_its_settings_to_the_mols_flags_and_refuses_unknown_options():
    import argparse

    from megatron_mech.config import MoLSOptions
    from megatron_mech.options import add_section_flags, section_from_flags

    arms = bm.expand_arms(_args(arms=["adamw", "mols:window=20,window-start=41"], window=5))
    flags = arms["mols:window=20,window-start=41"]
    parser = argparse.ArgumentParser()
    add_section_flags(parser, MoLSOptions)
    opts = section_from_flags(MoLSOptions, parser.parse_args(flags))
    assert opts.enabled and opts.window == 20 and opts.window_start == 41  # the arm's value beats --window 5
    with pytest.raises(ValueError, match="'windw=20' is not OPTION=VALUE"):
        bm.expand_arms(_args(arms=["adamw", "mols:windw=20"]))
    with pytest.raises(ValueError, match="'window' is not OPTION=VALUE"):
        bm.expand_arms(_args(arms=["adamw", "mols:window"]))


def test_arm_window_reads_the_arms_own_window_flags():
    a = _args(arms=["adamw", "mols", "mols:window=20,window-start=101"], window=None, steps=300)
    arms = bm.expand_arms(a)
    assert bm.arm_window(a, arms["mols"]) == (1, 5)                    # default: max(5, 1% of 300) from step 1
    assert bm.arm_window(a, arms["mols:window=20,window-start=101"]) == (101, 20)


def test_report_from_rerenders_a_results_json_and_keeps_the_runs_date(tmp_path, monkeypatch):
    """--report-from rebuilds the report of a results JSON from its own command and runs, and a JSON that is
    itself a re-rendering still names the date of the runs, not of the last rendering."""
    def write_results(name, text, data, command=None):   # the real layout, dated "RENDERED", under tmp_path
        (tmp_path / f"{name}.json").write_text(json.dumps({"command": command, "date": "RENDERED", **data}))
        (tmp_path / f"{name}.md").write_text(text)
        return tmp_path / f"{name}.md"

    monkeypatch.setattr(bm, "write_results", write_results)
    adamw = [_summary(s, f, [[150, f + 0.2], [300, f]]) for s, f in ((21, 5.10), (22, 5.12), (23, 5.08))]
    mols = [_summary(s, f, [[150, f + 0.1], [300, f]]) for s, f in ((21, 5.05), (22, 5.13), (23, 5.07))]
    command = "python benchmarks/bench_mols.py --seeds 21 22 23 --results-name rerender"
    source = tmp_path / "source.json"
    source.write_text(json.dumps({"command": command, "date": "RUNS", "runs": {"adamw@1": adamw, "mols@1": mols}}))
    expected, _ = bm.report(_args(), {"adamw": [], "mols": []}, {("adamw", 1.0): adamw, ("mols", 1.0): mols},
                            [1.0])
    bm.main(["--report-from", str(source)])
    first = (tmp_path / "rerender.md").read_text()
    assert first.startswith("Runs of RUNS;") and first.endswith(expected)
    bm.main(["--report-from", str(tmp_path / "rerender.json")])
    second = (tmp_path / "rerender.md").read_text()
    assert second.startswith("Runs of RUNS;") and "--report-from rerender.json" in second
    assert second.endswith(expected)
