"""The two detection benchmarks' scoring and report code on synthetic runs (no training): a clean run with one
alarm, and a run that diverges after the monitors and the max-logit signal fire."""
from __future__ import annotations

import argparse
import math

import pytest

from benchmarks import false_alarms, natural_instability
from megatron_mech.core.detect import Alert
from megatron_mech.studies.clean_scores import replay


def _records(n, collapse_at=None):
    out = []
    for i in range(n):
        v = 0.4 + 0.004 * ((i * 7) % 5)
        if collapse_at is not None and i >= collapse_at:
            v = 0.001
        out.append({"step": 5 * (i + 1), "metrics": {"attn/layer0/head0/delta2_entropy": v,
                                                     "attn/layer0/dwq_entropy": 0.5 + 0.005 * (i % 3),
                                                     "symptom/loss": 6.0 - 0.001 * i}})
    return out


def test_false_alarm_summary_and_report():
    runs = [{"name": "dense_h64_s21", "scores": replay(_records(120)), "command": "cmd"},
            {"name": "dense_h256_s21", "scores": replay(_records(120, collapse_at=100)), "command": "cmd"}]
    summary = false_alarms.summarize(runs, 1e4, 1e3)
    overall = next(r for r in summary["rates"] if r["group"] == "all")
    monitored = 120 - 50  # default rules: warm-up 30 + baseline 20 evaluations
    assert overall["series_evaluations"] == 2 * 3 * monitored and overall["alarms"] == 1
    assert overall["rate"] == pytest.approx(1 / (6 * monitored)) and overall["upper_95"] > overall["rate"]
    assert summary["alarms"] == [{"run": "dense_h256_s21", "metric": "attn/layer0/head0/delta2_entropy",
                                  "steps": [5 * (100 + 3)]}]
    args = argparse.Namespace(tuning_run=False, steps=600, seeds=[21], widths=[64, 256], models=["dense"],
                              scale_evaluations=1e4, scale_series=1e3, plan=None, from_corpus=False)
    text = false_alarms.report(args, runs, summary)
    assert "| all | 1 | 420 |" in text and "dense_h256_s21: `attn/layer0/head0/delta2_entropy`" in text
    # replayed from the corpus: the report names each run's model:width:steps:seed and where the series came from
    for run, width in zip(runs, (64, 256)):
        run.update(model="dense", width=width, steps=600, seed=21)
    text = false_alarms.report(argparse.Namespace(**{**vars(args), "from_corpus": True}), runs, summary)
    assert "every run of the clean corpus (`dense:64:600:21`, `dense:256:600:21`" in text
    assert "replayed from the committed clean corpus" in text


def test_false_alarm_plan():
    # Without a plan: the seeds × widths × models product at --steps and the preset's LR; with one: exactly its
    # entries, a fifth field scaling the preset's LR.
    assert false_alarms.parse_plan(None, [21, 22], [64], ["moe", "dense"], 600) == [
        ("moe", 64, 600, 21, 1.0), ("moe", 64, 600, 22, 1.0), ("dense", 64, 600, 21, 1.0), ("dense", 64, 600, 22, 1.0)]
    assert false_alarms.parse_plan(["moe:64:2000:21,23", "dense:256:1000:22:10"], [], [], [], 0) == [
        ("moe", 64, 2000, 21, 1.0), ("moe", 64, 2000, 23, 1.0), ("dense", 256, 1000, 22, 10.0)]
    for bad in ("moe:64:2000", "sparse:64:2000:21", "moe:64:x:21", "moe:64:2000:21:0", "moe:64:2000:21:nan",
                "moe:64:2000:21:3:1"):
        with pytest.raises(SystemExit, match="--plan entry"):
            false_alarms.parse_plan([bad], [], [], [], 0)


def test_false_alarm_run_at_a_scaled_lr():
    # The preset's --lr and --min-lr are multiplied, nothing else moves; the name says the scale.
    base = false_alarms.run_flags(64, True, 21, 1.0)
    scaled = false_alarms.run_flags(64, True, 21, 3.0)
    changed = {base[i - 1]: (base[i], scaled[i]) for i in range(1, len(base)) if base[i] != scaled[i]}
    assert set(changed) == {"--lr", "--min-lr"}
    assert all(float(new) == pytest.approx(3 * float(old)) for old, new in changed.values())
    assert false_alarms.run_name("moe", 64, 21, 1.0) == "moe_h64_s21"
    assert false_alarms.run_name("dense", 64, 21, 10.0) == "dense_h64_s21_lr10x"


def test_natural_instability_score_and_report():
    losses = [6.0] * 300 + [math.nan] * 10
    records = [{"step": 5 * (i + 1), "metrics": {"symptom/max_attn_logit": 5.0 if i < 52 else 80.0}}
               for i in range(62)]
    alerts = [Alert("attn/layer2/head1/delta2_entropy", "attention", 250, 0.001, 0.3, 12.0, {"layer": 2}),
              Alert("symptom/grad_norm", "symptom", 290, 9.0, 1.0, 20.0)]
    run = {"losses": losses, "alerts": alerts, "records": records, "command": "cmd"}
    s = natural_instability.score(run, steps=310, margin=1.0)
    assert s["divergence"] == 301 and s["first_family"] == "attention" and s["first_monitor_alert"] == 250
    assert s["lead"]["monitors"] == 51 and s["lead_fraction"] == pytest.approx(51 / 301)
    assert s["signals"]["max attention logit"] == 5 * (52 + 5) and s["lead"]["max attention logit"] == 301 - 285
    assert s["signals"]["loss spike (10× early max)"] == 301
    args = argparse.Namespace(tuning_run=False, model="dense", width=64, steps=310, seeds=[21], margin=1.0,
                              warmup=None, independent_weight_decay=None,
                              mech_interval=5, stop_at=None)
    text = natural_instability.report(args, [{"lr": 0.03, "qk_layernorm": False, "seed": 21, "score": s,
                                              "command": "cmd"}])
    assert "runs that diverged: 1 of 1; monitors alerted before divergence in 1" in text
    assert "after a 15-step linear warm-up" in text          # default: a twentieth of the run
    args.warmup = 1000
    assert "after a 1000-step linear warm-up" in natural_instability.report(args, [])
    assert "monitors ahead of **max attention logit**" in text


def test_natural_instability_independent_weight_decay_and_max_logit_trajectory():
    # Megatron's AdamW decays by lr_t × wd per step: wd = 1e-4 / lr shrinks by 1e-4 per step at the peak lr
    args = argparse.Namespace(width=128, model="dense", warmup=400, independent_weight_decay=1e-4, mech_interval=2)
    flags = natural_instability.run_flags(args, 0.5, True, 11)
    assert flags[flags.index("--weight-decay") + 1] == "0.0002" and flags[-1] == "--qk-layernorm"
    assert flags.count("--mech-interval") == 1 and flags[flags.index("--mech-interval") + 1] == "2"
    assert natural_instability.run_name(args, 0.5, True, 11) == "dense_h128_lr0.5_qkln_s11_w400_iwd0.0001_i2"
    args.mech_interval = 5
    args.independent_weight_decay = None  # the entry point's own --weight-decay, and the old run names
    assert "--weight-decay" not in natural_instability.run_flags(args, 0.5, False, 11)
    assert natural_instability.run_name(args, 0.5, False, 11) == "dense_h128_lr0.5_plain_s11_w400"
    with pytest.raises(ValueError, match="--independent-weight-decay"):
        natural_instability.coupled_weight_decay(-1e-4, 0.5)
    records = [{"step": 5 * i, "metrics": {"symptom/max_attn_logit": float(10 * i)}} for i in range(1, 31)]
    records.insert(3, {"step": 17, "metrics": {"symptom/loss": 3.0}})  # a record without the series is skipped
    trajectory = natural_instability.max_logit_trajectory(records)
    assert trajectory == {"every": {50: 100.0, 100: 200.0, 150: 300.0}, "max": 300.0}
    row = {"lr": 0.5, "qk_layernorm": False, "seed": 21, "command": "cmd", "max_logit": trajectory,
           "score": natural_instability.score({"losses": [6.0] * 150, "alerts": [], "records": records,
                                               "command": "cmd"}, steps=150, margin=1.0)}
    args = argparse.Namespace(tuning_run=False, model="dense", width=128, steps=150, seeds=[21], margin=1.0,
                              warmup=None, independent_weight_decay=1e-4, mech_interval=2, stop_at=None)
    text = natural_instability.report(args, [row])
    assert "- lr 0.5, plain, seed 21: 50: 100, 100: 200, 150: 300 (max 300.00)" in text
    assert "independent weight decay 0.0001 per step at the peak LR" in text and "4 heads of 32" in text
    assert "monitors every 2 steps" in text
    with pytest.raises(SystemExit):  # refused before any run starts
        natural_instability.main(["--mech-interval", "0", "--no-write"])


def test_stopped_runs_keep_the_schedule_of_the_full_run_and_count_as_finished(tmp_path, monkeypatch):
    # A run stopped at step 500 of a 1200-step schedule: trained with --train-iters 1200 and --exit-interval 500
    # (the LR schedule and the data of the 1200-step run), and reused once it reached step 500.
    import json
    import subprocess

    from benchmarks import _train_runs
    calls = []

    def fake_run(cmd, **kwargs):
        calls.append(cmd)
        (tmp_path / "run" / "summary.json").write_text(json.dumps({"final_step": 500, "losses": [5.0] * 500}))
        (tmp_path / "run" / "mech.jsonl").write_text(json.dumps({"step": 5, "metrics": {"symptom/loss": 5.0}}) + "\n")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(_train_runs.subprocess, "run", fake_run)
    run = _train_runs.train_run(tmp_path / "run", ["--seed", "21"], 1200, reuse=True, stop_at=500)
    (cmd,) = calls
    assert cmd[cmd.index("--train-iters") + 1] == "1200" and cmd[cmd.index("--exit-interval") + 1] == "500"
    assert "--exit-interval 500" in run["command"] and len(run["losses"]) == 500
    _train_runs.train_run(tmp_path / "run", ["--seed", "21"], 1200, reuse=True, stop_at=500)
    assert len(calls) == 1  # finished at its stop: reused, not resumed toward 1200
    with pytest.raises(ValueError, match="stop_at"):
        _train_runs.train_run(tmp_path / "other", ["--seed", "21"], 1200, reuse=True, stop_at=1200)
    args = argparse.Namespace(tuning_run=False, model="moe", width=64, steps=1200, seeds=[21], margin=1.0,
                              warmup=1000, independent_weight_decay=None, mech_interval=5, stop_at=500)
    assert "1200 steps stopped after step 500, monitors every 5 steps" in natural_instability.report(args, [])
    with pytest.raises(SystemExit):  # a stop at or past the end is refused before any run starts
        natural_instability.main(["--steps", "500", "--stop-at", "500", "--no-write"])


@pytest.mark.timeout(60)
def test_false_alarm_level_replay_on_the_global_maximum_and_the_share_bounds():
    import math

    import torch

    # The bounds hold the true busiest excess of share vectors (4 experts, top-2: excess = (max − 1/4) / (1/4)).
    gen = torch.Generator().manual_seed(0)
    for shares in [torch.tensor([0.5, 0.3, 0.1, 0.1]), torch.tensor([0.25] * 4), torch.tensor([0.5, 0.5, 0, 0]),
                   *torch.rand(40, 4, generator=gen)]:
        shares = (shares / shares.sum()).double()
        if float(shares.max()) > 0.5:  # not a top-2 routing (one expert at most 1/k = 1/2)
            continue
        cv = float(shares.std(correction=0) / shares.mean())
        excess = (float(shares.max()) - 0.25) / 0.25
        lower, upper = false_alarms.share_excess_bounds(cv, 4, 2)
        assert lower - 1e-12 <= excess <= upper + 1e-12, (shares, lower, excess, upper)
    assert false_alarms.share_excess_bounds(1.0, 4, 2) == pytest.approx((1.0, math.sqrt(3)))
    # Global max logit 50, 120, 130, 90, 150 at steps 5–25: the level rule (> 100, persistence 1, latched) fires at
    # 10, holds at 15, re-arms at 20 and fires at 25. Load CV 0.1, 0.8, 0.5: lower bounds c² = 0.01, 0.64, 0.25 and
    # upper √3·c = 0.17, 1.39, 0.87 against 0.5: step 10 certainly above, step 15 possibly, step 5 certainly not.
    records = [{"step": 5 * (i + 1), "metrics": {"symptom/max_attn_logit": v, **(
        {"router/layer2/load_cv": c} if c is not None else {})}}
        for i, (v, c) in enumerate(zip([50.0, 120.0, 130.0, 90.0, 150.0], [0.1, 0.8, 0.5, None, None]))]
    out = false_alarms.level_replay(records)
    assert out["logit_alarms"] == [10, 25] and out["logit_evaluations"] == 5 and out["logit_max"] == 150.0
    assert out["share_certainly_above"] == [[10, 2]] and out["share_possibly_above"] == 1
    assert out["share_evaluations"] == 3 and out["share_lower_max_at"] == [10, 2] and not out["level_series_recorded"]
    text = "\n".join(false_alarms.level_lines([{"name": "moe_h64_s21", "levels": out}]))
    assert "**2 alarms** over 5 evaluations" in text and "moe_h64_s21 step 10, moe_h64_s21 step 25" in text
    assert "**1 certainly above the level**" in text and "the rule is off by default" in text


def test_trend_window_thresholds_and_choice():
    from benchmarks import trend_window
    from megatron_mech.core.detect import LAYER_TREND_THRESHOLD, LAYER_TREND_WINDOW

    # Every window gets the default's margin over its own clean maximum, rounded up to 0.05; the default keeps its own.
    corpus_max = {LAYER_TREND_WINDOW: LAYER_TREND_THRESHOLD / 2, 5: 1.01, 20: 0.5}
    assert trend_window.thresholds(corpus_max) == {LAYER_TREND_WINDOW: LAYER_TREND_THRESHOLD, 5: 2.05, 20: 1.0}

    def rows(*leads, clean=0, layer=trend_window.FAULTY_LAYER):
        return [{"lead": lead, "clean_alerts": clean, "layer": layer} for lead in leads]
    # the largest smallest lead wins; then the mean; a tie keeps the default window
    assert trend_window.choose({LAYER_TREND_WINDOW: rows(15, 20), 5: rows(20, 20)}) == 5
    assert trend_window.choose({LAYER_TREND_WINDOW: rows(15, 20), 5: rows(15, 25)}) == 5
    assert trend_window.choose({LAYER_TREND_WINDOW: rows(15, 20), 5: rows(20, 15)}) == LAYER_TREND_WINDOW
    # a miss, a clean-run alert or an alert in another layer puts a window out, however early its other seeds
    for bad in (rows(40, None), rows(40, 40, clean=1), rows(40, 40, layer=trend_window.FAULTY_LAYER + 1)):
        assert trend_window.choose({LAYER_TREND_WINDOW: rows(5, 5), 5: bad}) == LAYER_TREND_WINDOW


def test_a_run_that_failed_on_its_own_is_not_a_clean_run():
    # Against the early-warning benchmark's outcomes, computed by hand: the max logit held at >= 200 for 10 records
    # from the 21st record (step 105); losses at 5 then 7 from step 201: the trailing 20-step average is first more
    # than 1 nat above its best (5) when 11 of its 20 losses are 7, at step 211, and stays there to the end.
    records = [{"step": 5 * (i + 1), "metrics": {"symptom/max_attn_logit": 250.0 if i >= 20 else 20.0}}
               for i in range(40)]
    calm = [{"step": r["step"], "metrics": {"symptom/max_attn_logit": 20.0}} for r in records]
    assert false_alarms.failure([5.0] * 200, calm) == {}
    assert false_alarms.failure([5.0] * 200, records) == {"max logit exploded": 105}
    diverged = [5.0] * 200 + [7.0] * 100
    assert false_alarms.failure(diverged, calm) == {"loss diverged": 211}
    # a logit that passes 200 for 9 records only is not an explosion
    short = [{"step": 5 * (i + 1), "metrics": {"symptom/max_attn_logit": 250.0 if 20 <= i < 29 else 20.0}}
             for i in range(40)]
    assert false_alarms.failure([5.0] * 200, short) == {}
    args = argparse.Namespace(tuning_run=False, steps=600, seeds=[21], widths=[64], models=["moe"],
                              scale_evaluations=1e4, scale_series=1e3, plan=["moe:64:600:21:10"], from_corpus=False)
    runs = [{"name": "dense_h64_s21", "scores": replay(_records(120)), "command": "cmd"}]
    left_out = [{"name": "moe_h64_s21_lr10x", "failure": {"max logit exploded": 105},
                 "first_alerts": "attention 85 (`symptom/max_attn_logit/layer0`)"}]
    text = false_alarms.report(args, runs, false_alarms.summarize(runs, 1e4, 1e3), left_out)
    assert "## Runs left out: not clean" in text
    assert "- moe_h64_s21_lr10x: max logit exploded from step 105; first alerts: attention 85" in text


def test_lead_time_scores_each_fault_run_against_the_incumbents_from_its_onset():
    # Clean and fault runs of 200 steps, fault from 100; losses equal (no divergence). The fault run's attention
    # alert is at 110; its grad norm is 30 at step 153 only (over the level 20: the first counted incumbent, read
    # from the per-step series, between two records). The clean run's grad norm crosses 20 at step 60, before the
    # onset: that firing is not from the onset and is not a reason to discount the fault run's.
    from benchmarks import lead_time

    def run(grad_norm, alerts):
        return {"losses": [3.0] * 200, "grad_norms": [grad_norm(s) for s in range(1, 201)], "alerts": alerts,
                "records": [{"step": s, "metrics": {"symptom/grad_norm": grad_norm(s), "symptom/max_attn_logit": 10.0}}
                            for s in range(5, 201, 5)], "seed": 21}

    alert = Alert(metric="attn/layer1/head0/delta2_entropy", family="attention", step=110, value=0.01,
                  baseline=0.2, score=9.0)
    clean = run(lambda s: 30.0 if s == 60 else 1.0, [])
    fault = run(lambda s: 30.0 if s == 153 else 1.0, [alert])
    row = lead_time.incumbents_row("slow_attention", fault, clean, 100, 0.2)
    assert row["who"] == "attention" and row["first"] == 110 and row["first_incumbent"][0] == 153
    assert row["firings"]["grad norm > 20"] == row["firings"]["ZClip grad-norm z-score"] == 153  # a 30× spike
    assert row["not_counted"] == {} and row["lead"] == 43 and row["verdict"].startswith("**early**")
    assert row["clean_rings"] == {}  # the clean run's one spike (step 60) is before the onset
    # the same spike on the clean run at an earlier step after the onset: rings without the fault, not counted
    clean = run(lambda s: 30.0 if s == 120 else 1.0, [])
    row = lead_time.incumbents_row("slow_attention", fault, clean, 100, 0.2)
    assert row["not_counted"]["grad norm > 20"] == 120 and row["first_incumbent"] is None
    assert row["clean_rings"]["grad norm > 20"] == 1
    from megatron_mech.studies.demo import not_counted_text
    assert not_counted_text({"grad norm > 20": 120}, row["clean_rings"]) == "grad norm > 20 (from 120, at 1 step)"
    # the clean run rings twice, both after the fault run's spike (steps 160 and 170): the rule rings without the
    # fault all the same, so the fault run's spike is not counted either, and the count says how often it rang
    clean = run(lambda s: 30.0 if s in (160, 170) else 1.0, [])
    row = lead_time.incumbents_row("slow_attention", fault, clean, 100, 0.2)
    assert row["first_incumbent"] is None and row["not_counted"]["grad norm > 20"] == 160
    assert row["clean_rings"]["grad norm > 20"] == 2 and row["verdict"].startswith("**early**")


def test_the_placebo_credits_a_rule_ringing_on_clean_runs_only_under_the_as_early_criterion():
    # Three clean runs, no fault. Seed 1's grad norm spikes to 30 (over the level 20, a ZClip z-score spike too)
    # 20 steps after the onset, seed 2's 50 steps after, seed 3's never. Scored against seed 2, seed 1's spike is
    # "earlier than on the clean run": as_early counts it, silent does not (seed 2 rang). Against seed 3 (silent)
    # both count it. Seed 2 against seed 1 (which rang earlier) and seed 3 against anyone: nothing counted.
    from benchmarks import incumbent_placebo

    start = incumbent_placebo.START

    def clean(spike):
        grad_norm = lambda s: 30.0 if spike is not None and s == start + spike else 1.0  # noqa: E731
        return {"clean": {"losses": [3.0] * (start + 100), "grad_norms": [grad_norm(s) for s in range(1, start + 101)],
                          "alerts": [], "seed": 0,
                          "records": [{"step": s, "metrics": {"symptom/grad_norm": grad_norm(s),
                                                              "symptom/max_attn_logit": 10.0}}
                                      for s in range(5, start + 101, 5)]}}

    runs = {1: clean(20), 2: clean(50), 3: clean(None)}
    rows = {(r["fault_seed"], r["clean_seed"]): r for r in incumbent_placebo.placebo(runs)}
    assert rows[1, 2]["as_early"] == (start + 20, "ZClip grad-norm z-score") and rows[1, 2]["silent"] is None
    assert rows[1, 3]["as_early"] == rows[1, 3]["silent"] == (start + 20, "ZClip grad-norm z-score")
    assert rows[2, 1]["as_early"] is None and rows[2, 1]["silent"] is None
    assert rows[2, 3]["silent"] == (start + 50, "ZClip grad-norm z-score")
    assert all(rows[3, y]["as_early"] is None and rows[3, y]["silent"] is None for y in (1, 2))
    assert all(r["monitor_alerts"] == 0 for r in rows.values())
    # 3 of 6 pairs credit a false warning under as_early (1→2, 1→3, 2→3), 2 under silent (1→3, 2→3); the rule
    # picks silent only where it also still counts an incumbent on every fault act, and states a choice only on
    # tuning seeds
    acts = [{"seed": 1, "act": "attention", "as_early": (300, "OLMo grad-norm spike"),
             "silent": (300, "OLMo grad-norm spike")}]
    text = incumbent_placebo.report([11, 1234, 12], list(rows.values()), acts, incumbent_placebo.ring_counts(runs))
    assert "`as_early`: a false warning counted on 3 of 6" in text and "`silent`: a false warning counted on 2 of 6" in text
    assert text.split("- choice")[1].split("\n")[0].endswith("`silent`")
    gives_up = [{**acts[0], "silent": None}]  # silent would count no incumbent on a fault act: as_early kept
    assert incumbent_placebo.choose(list(rows.values()), gives_up) == "as_early"
    assert incumbent_placebo.choose(list(rows.values()), acts) == "silent"
    assert "- choice" not in incumbent_placebo.report([21, 22, 23], list(rows.values()), [],
                                                      incumbent_placebo.ring_counts(runs))
