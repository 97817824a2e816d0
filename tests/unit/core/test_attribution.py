"""Alert grouping and the human attribution lines."""
from megatron_mech.core.attribution import alert_lines, summarize_alerts
from megatron_mech.core.detect import Alert


def alert(metric, family, step, value, baseline, score, **detail):
    return Alert(metric, family, step, value, baseline, score, detail)


def test_groups_by_family_and_layer_and_quotes_first_order_term():
    alerts = [
        alert("attn/layer1/head3/delta3_entropy", "attention", 140, 0.02, 0.3, 9.0, layer=1, head=3, term="delta3"),
        alert("attn/layer1/head5/delta2_entropy", "attention", 150, 0.41, 0.83, 7.0, layer=1, head=5, term="delta2"),
        alert("attn/layer1/head3/delta2_entropy", "attention", 140, 0.40, 0.80, 8.0, layer=1, head=3, term="delta2"),
        alert("attn/layer1/dwq_entropy", "attention", 160, 0.2, 0.45, 7.5, layer=1, matrix="q"),
        alert("router/layer0/load_entropy", "router", 300, 0.7, 0.99, 6.5, layer=0, expert=2, expert_load=0.6),
        alert("symptom/loss", "symptom", 500, 6.0, 5.0, 12.0),
    ]
    groups = summarize_alerts(alerts)
    assert [(g["family"], g["layer"]) for g in groups] == [("attention", 1), ("router", 0), ("symptom", None)]
    attention = groups[0]
    assert attention["heads"] == [3, 5] and attention["first_step"] == 140 and attention["count"] == 4
    assert attention["metric"] == "attn/layer1/head3/delta2_entropy"  # Δ2 quoted before Δ3 and ΔW
    lines = alert_lines(alerts)
    assert lines[0] == ("attention-precision fault suspected in layer 1, heads 3 and 5 "
                        "(Δ2 spectral entropy 0.4 vs baseline 0.8, score 8.0, since step 140)")
    # later alerts are marked as following the first cause, each named by its family, place, metric and rule
    assert lines[1].startswith("after the attention-precision fault (step 140), likely its consequence: router "
                               "layer 0, busiest expert 2 (expert-load entropy 0.7 vs baseline 0.99")
    assert lines[2].startswith("after the attention-precision fault (step 140), likely its consequence: symptom "
                               "(loss 6 vs baseline 5")
    assert [g["cause"] for g in groups] == ["precision", "router", "data"]  # each one's own cause at its step
    assert [g["follows"] for g in groups] == [None] + [{"cause": "precision", "step": 140}] * 2
    assert [g["rule"] for g in groups] == ["baseline"] * 3


def test_same_step_groups_strongest_evidence_first():
    """Two layers alerting in the same evaluation: the one furthest from its own baseline is named first."""
    alerts = [alert("attn/layer0/head0/delta2_entropy", "attention", 75, 0.11, 0.57, 7.2, layer=0, head=0),
              alert("attn/layer1/head3/delta2_entropy", "attention", 75, 0.026, 0.49, 9.5, layer=1, head=3)]
    assert [g["layer"] for g in summarize_alerts(alerts)] == [1, 0]
    assert alert_lines(alerts)[0].startswith("attention-precision fault suspected in layer 1, head 3")


def test_global_blowup_is_one_nonfinite_line_not_a_layer_or_router_diagnosis():
    nan, inf = float("nan"), float("inf")
    alerts = [alert("attn/layer0/head0/delta2_entropy", "attention", 40, nan, 0.5, inf, layer=0, head=0),
              alert("attn/layer2/dwq_entropy", "attention", 40, nan, 0.5, inf, layer=2),
              alert("router/layer1/entropy_mean", "router", 40, nan, 1.2, inf, layer=1),
              alert("symptom/loss", "symptom", 40, nan, 5.0, inf),
              alert("symptom/grad_norm", "symptom", 40, inf, nan, inf)]
    groups = summarize_alerts(alerts)
    assert len(groups) == 1 and groups[0]["family"] == "nonfinite" and groups[0]["count"] == 5
    line = alert_lines(alerts)[0]
    assert line.startswith("training went non-finite at step 40: loss, grad-norm and 3 monitor series at once")
    assert "router collapse" not in line and "layer 0" not in line
    # one non-finite series alone is still that series' own alert, named by place
    single = [alert("attn/layer1/head2/delta2_entropy", "attention", 50, nan, nan, inf, layer=1, head=2)]
    assert alert_lines(single)[0] == ("attention-precision fault suspected in layer 1, head 2 "
                                      "(Δ2 spectral entropy non-finite (nan), since step 50)")
