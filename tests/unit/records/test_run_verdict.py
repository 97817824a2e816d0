"""The verdict line of report.md: the first alert's diagnosis, or "No alerts fired." with whether the detectors were
armed — the silence of a run that ended before its baseline-relative rules armed is no verdict on its health."""
from megatron_mech.core.detect import Alert
from megatron_mech.records.report import run_verdict, summarize_run
from megatron_mech.records.report_guides import Arming


def records(last_step, interval=5, alerts=()):
    return [{"step": s, "loss": 3.0 - 0.01 * s, "grad_norm": 1.0, "lr": 1e-3, "metrics": {},
             "alerts": [a.to_dict() for a in alerts if a.step == s]} for s in range(interval, last_step + 1, interval)]


def test_a_run_that_ended_before_the_detectors_armed_says_so():
    md = summarize_run(records(20), arming=Arming(265, "summary.json"))
    sentence = ("No alerts fired, and the detectors never armed: the run ended at step 20, the first "
                "baseline-relative rule arms at step 265")
    assert sentence in md and "- **Verdict:** " + sentence in md
    assert "\nNo alerts fired.\n" not in md


def test_an_armed_run_without_alerts_says_it_was_armed():
    md = summarize_run(records(300), arming=Arming(265, "summary.json"))
    assert "No alerts fired (detectors armed from step 265; the run ended at step 300)." in md


def test_a_run_with_alerts_gives_the_first_alerts_diagnosis():
    logit = Alert("symptom/max_attn_logit/layer1", "attention", 10, 450.0, 100.0, 4.5,
                  {"layer": 1, "head": 0, "level": 100.0})
    assert run_verdict([logit], 20, 265) == "First alert at step 10: attention-logit growth suspected in layer 1."
    md = summarize_run(records(20, alerts=[logit]), arming=Arming(265, "summary.json"))
    assert "- **Verdict:** First alert at step 10: attention-logit growth suspected in layer 1." in md
    assert "max attention logit 450 above level 100, since step 10" in md
