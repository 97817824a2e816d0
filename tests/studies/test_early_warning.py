"""The early-warning benchmark's scoring: leads, late firings, misses and false alarms against the outcomes."""
from __future__ import annotations

import pytest

from benchmarks import early_warning
from megatron_mech.core.detect import Alert


def test_judge_classifies_each_firing_against_the_outcome():
    assert early_warning.judge(200, 150) == {"kind": "early", "lead": 50, "fraction": 0.25, "fired": 150}
    assert early_warning.judge(200, 260)["kind"] == "late" and early_warning.judge(200, 260)["lead"] == -60
    assert early_warning.judge(200, None)["kind"] == "miss"
    assert early_warning.judge(None, 90) == {"kind": "false alarm", "lead": None, "fraction": None, "fired": 90}
    assert early_warning.judge(None, None)["kind"] == "quiet"
    assert early_warning.cell(early_warning.judge(200, 150)) == "+50 (0.25)"
    assert early_warning.cell(early_warning.judge(200, 260)) == "-60"
    assert early_warning.cell(early_warning.judge(None, 90)) == "FA@90"


def _run(losses, grad_norms, max_logits, alerts=()):
    steps = [5 * (i + 1) for i in range(len(grad_norms))]
    return {"dir": "run", "losses": losses, "alerts": list(alerts), "grad_norm": (steps, grad_norms),
            "max_logit": (steps, max_logits)}


def test_rule_firings_and_outcomes_on_a_synthetic_pair():
    # 200 steps, records every 5. The run: loss 3.0, then 3.6 from step 101 (no divergence: 0.6 < 1 nat above its
    # best; lasting gap > 0.3 above the twin from step 111: 11 × 0.6 / 20 = 0.33); max logit 10 like the twin
    # until step 50, then 150 (≥ the level 100 from step 55: held 10 records from 55).
    twin = _run([3.0] * 200, [1.0] * 40, [10.0] * 40)
    run = _run([3.0] * 100 + [3.6] * 100, [1.0] * 20 + [2.5] * 20, [10.0] * 10 + [150.0] * 30,
               [Alert("attn/layer1/head0/delta2_entropy", "attention", 90, 0.1, 0.3, 9.0),
                Alert("router/layer0/entropy_mean", "router", 150, 1.0, 1.3, 6.5)])
    criteria = {"divergence_margin": 1.0, "loss_gap": 0.3, "logit_level": 100.0, "logit_hold": 10,
                "grad_norm_level": 2.0}
    found = early_warning.outcomes(run, twin, criteria)
    assert found["run"] == 111 and found["attention"] == 55 and found["first"] == 55 and found["router"] is None
    fired = early_warning.rule_firings(run, 2.0)
    assert fired["attention monitor"] == 90 and fired["router monitor"] == 150
    assert fired["max logit > 100 (QK-clip)"] == 55 and fired["grad norm > 2"] == 105
    # The loss rises 0.6 (not 10×; the OLMo window of 128 steps holds a flat 3.0 at step 101 → std 0 → no fire).
    assert fired["Megatron spiky loss"] is None and fired["OLMo loss spike"] is None
    # A router outcome plugged in counts as an outcome too.
    found = early_warning.outcomes(run, twin, criteria, router_outcome=lambda run_dir: 40)
    assert found["router"] == 40 and found["first"] == 40


def test_firings_on_the_healthy_twin_are_false_alarms_and_quiet_rules_are_quiet():
    twin = _run([3.0] * 200, [1.0] * 40, [10.0] * 40,
                [Alert("router/layer0/entropy_mean", "router", 120, 1.0, 1.3, 7.0)])
    run = _run([3.0] * 100 + [3.6] * 100, [1.0] * 40, [10.0] * 40)
    criteria = {"divergence_margin": 1.0, "loss_gap": 0.3, "logit_level": 100.0, "logit_hold": 10,
                "grad_norm_level": 2.0}
    scored = early_warning.score_pair(run, twin, criteria)
    assert scored["twin"]["outcomes"]["first"] is None
    assert scored["twin"]["judged"]["router monitor"]["kind"] == "false alarm"
    assert scored["twin"]["judged"]["attention monitor"]["kind"] == "quiet"
    # On the run (lasting gap from step 111) the router never fired: a miss; the final gap is the last 20 steps'.
    assert scored["judged"]["router monitor"]["kind"] == "miss" and scored["outcomes"]["first"] == 111
    assert scored["final_gap"] == pytest.approx(0.6)


def test_microbatches_per_rank_from_the_preset_flags():
    flags = ["--global-batch-size", "16", "--micro-batch-size", "2"]
    assert early_warning.microbatches_per_rank(flags, 2) == 4
    assert early_warning.MEGATRON_SAMPLES_IN_STEPS == pytest.approx(100 / early_warning.MICROBATCHES, abs=1)


def test_router_outcome_flag_names_a_function_or_fails_naming_the_flag():
    assert early_warning.load_router_outcome(None) is None
    assert early_warning.load_router_outcome("math:isfinite") is __import__("math").isfinite
    with pytest.raises(SystemExit, match="--router-outcome"):
        early_warning.load_router_outcome("megatron_mech.studies.outcomes")


def _write_run(folder, losses, grad_norms):
    import json

    from run_summaries import write_summary_file
    folder.mkdir(parents=True)
    write_summary_file(folder / "summary.json", first_step=1, final_step=len(losses), losses=losses)
    (folder / "mech.jsonl").write_text("".join(
        json.dumps({"step": 5 * (i + 1), "metrics": {"symptom/grad_norm": g, "symptom/max_attn_logit": 1.0}}) + "\n"
        for i, g in enumerate(grad_norms)))


def test_warmup_runs_are_read_from_their_folders_with_twins_from_another(tmp_path, monkeypatch):
    # The warm-up run (folder ..._w1000) diverges with a non-finite loss at step 150, its grad norm passes 20 at
    # step 100; the twin lives in another folder and is flat. A run without the _w suffix in --runs-dir would be
    # scored instead if the option did not select the warm-up folder: it is absent, so that would fail to load.
    runs, twins = tmp_path / "runs", tmp_path / "twins"
    _write_run(runs / "moe_h64_lr1.5_plain_s21_w1000", [3.0] * 149 + [float("nan")] * 51,
               [1.0] * 19 + [30.0] * 21)
    _write_run(twins / "moe_h64_lr0.002_plain_s21", [3.0] * 200, [1.0] * 40)
    rows = {}
    monkeypatch.setattr(early_warning, "write_results",
                        lambda name, text, data: rows.update(name=name, text=text, **data))
    early_warning.main(["--runs-dir", str(runs), "--twins-dir", str(twins), "--seeds", "21", "--lr", "1.5",
                        "--warmup", "1000", "--schedule-steps", "1200", "--steps", "200",
                        "--results-name", "early_warning_warmup"])
    (row,) = rows["rows"]
    assert rows["name"] == "early_warning_warmup" and row["name"] == "moe_h64_lr1.5_plain_s21_w1000"
    assert row["outcomes"]["divergence"] == 150 and row["firings"]["grad norm > 20"] == 100
    assert row["judged"]["grad norm > 20"]["lead"] == 50
    assert row["judged_vs_divergence"]["grad norm > 20"] == {"kind": "early", "lead": 50, "fraction": 50 / 150,
                                                             "fired": 100}
    assert "## Lead against divergence only" in rows["text"]  # every run diverged
    assert row["twin"]["judged"]["grad norm > 20"]["kind"] == "quiet"
    with pytest.raises(SystemExit):  # --schedule-steps only describes warm-up runs
        early_warning.main(["--runs-dir", str(runs), "--seeds", "21", "--schedule-steps", "1200", "--no-write"])
