"""The per-layer maximum attention logit (``symptom/max_attn_logit/layer{L}``) and its head: the recorder in one
process against the per-pair definition, the split over ranks as TP and PP split it (``workers/
max_logit_ranks_worker.py``, 2 gloo ranks), and the hook alerting on it from the first evaluation through a real
attention layer."""
from __future__ import annotations

import logging
import math

import pytest
import torch

from dist_utils import WORKERS, run_torchrun
from megatron_mech.config import MechConfig, MonitorConfig
from megatron_mech.hook import MechHook
from megatron_mech.model_view import ModelView
from megatron_mech.monitors.attention import AttentionLayer
from megatron_mech.monitors.max_logit import MAX_LOGIT_METRIC, MaxLogitRecorder
from megatron_mech.records.sinks import CallbackSink

pytestmark = pytest.mark.timeout(300)


def head_maxima(q, k, scale):
    """Per query head, the largest causal ``scale·q·k`` over batch and pairs, in float64, pair by pair."""
    b, h, s, _ = q.shape
    per_group = h // k.shape[1]
    out = []
    for head in range(h):
        best = -math.inf
        for bi in range(b):
            for i in range(s):
                for j in range(i + 1):
                    best = max(best, float(q[bi, head, i].double() @ k[bi, head // per_group, j].double()) * scale)
        out.append(best)
    return out


def test_recorder_keeps_each_layers_maximum_over_micro_batches_and_names_its_global_head():
    gen = torch.Generator().manual_seed(1)
    recorder = MaxLogitRecorder(num_layers=3, head_offsets={0: 4, 2: 4})  # this rank holds heads 4..7
    recorder.capturing = True
    batches = {layer: [(torch.randn(1, 4, 5, 8, generator=gen), torch.randn(1, 2, 5, 8, generator=gen))
                       for _ in range(2)] for layer in (0, 2)}
    batches[2][1][0][:, 2] *= 4  # local head 2 of layer 2, in the second micro-batch: global head 6
    for layer, pairs in batches.items():
        for q, k in pairs:
            recorder(layer, q, k, 0.25, True)
    metrics, details = recorder.observe_layers()
    assert sorted(metrics) == [f"{MAX_LOGIT_METRIC}/layer0", f"{MAX_LOGIT_METRIC}/layer2"]  # layer 1: not recorded
    for layer, pairs in batches.items():
        per_head = [max(values) for values in zip(*(head_maxima(q, k, 0.25) for q, k in pairs))]
        best = max(range(4), key=lambda h: per_head[h])
        name = f"{MAX_LOGIT_METRIC}/layer{layer}"
        assert metrics[name] == pytest.approx(per_head[best], rel=1e-5)  # float32 products vs float64 pairs
        assert details[name] == {"layer": layer, "head": 4 + best}
    assert details[f"{MAX_LOGIT_METRIC}/layer2"]["head"] == 6
    # the global maximum is the largest layer's, and both reset after an evaluation
    assert recorder.observe()[MAX_LOGIT_METRIC] == pytest.approx(max(metrics.values()), rel=1e-12)
    assert recorder.observe_layers() == ({}, {}) and recorder.observe() == {}


def test_a_nan_head_makes_its_layer_nan_and_names_that_head(caplog):
    recorder = MaxLogitRecorder(num_layers=1)
    recorder.capturing = True
    q, k = torch.randn(1, 3, 4, 2), torch.randn(1, 3, 4, 2)
    q[0, 2, 1, 0] = math.nan
    recorder(0, q, k, 1.0, True)
    with caplog.at_level(logging.WARNING, logger="megatron_mech"):
        recorder(5, q, k, 1.0, True)  # beyond the model's layers: said once, not kept
        recorder(6, q, k, 1.0, True)
    metrics, details = recorder.observe_layers()
    assert math.isnan(metrics[f"{MAX_LOGIT_METRIC}/layer0"]) and details[f"{MAX_LOGIT_METRIC}/layer0"]["head"] == 2
    assert list(metrics) == [f"{MAX_LOGIT_METRIC}/layer0"]
    assert [r.getMessage() for r in caplog.records if "outside the model" in r.getMessage()] == [
        "[mech] max attention logit: layer 5 is outside the model's 1 layers; its per-layer maximum is not recorded "
        "(the global one is)"]


@pytest.mark.distributed
def test_the_maximum_and_its_head_are_exact_when_ranks_split_heads_or_layers():
    out = run_torchrun(WORKERS / "max_logit_ranks_worker.py", nproc=2, timeout=240)
    assert "MAX_LOGIT_RANKS PASS" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]


class TinyAttention(torch.nn.Module):
    """One causal self-attention layer (fused QKV, 2 heads) handing its q, k to a capture hook."""

    def __init__(self, d_model=16, heads=2, head_dim=8):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.qkv = torch.nn.Linear(d_model, 3 * heads * head_dim, bias=False)
        self.record = None

    def qk(self, x):
        b, s, _ = x.shape
        q, k, _ = self.qkv(x).view(b, s, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        return q, k

    def forward(self, x):
        q, k = self.qk(x)
        if self.record is not None:
            self.record(0, q, k, self.head_dim ** -0.5, True)
        return q.sum()


def test_hook_alerts_at_the_first_evaluation_when_a_layers_maximum_passes_the_qk_clip_level():
    """With the default rules (warm-up 30 + baseline 20 + persistence 3 evaluations before any baseline-relative
    alert) the level rule fires at the run's first evaluation, step 3, naming layer 0 and the head holding it."""
    torch.manual_seed(0)
    model = TinyAttention()
    with torch.no_grad():
        model.qkv.weight[8:16] *= 150  # head 1's queries: logits in the hundreds
    view = ModelView(attention_layers=[AttentionLayer(0, model.qkv.weight, 2, 2, 8)],
                     attention_logit_capture=[lambda record: setattr(model, "record", record)])
    records = []
    hook = MechHook(MechConfig(monitors=MonitorConfig(families=("attention",), interval=3, qk_terms=("delta2",))),
                    train_steps=30, sinks=CallbackSink(records.append))
    hook.setup(view, None)
    assert "level rules armed from the first evaluation (step 3): symptom/max_attn_logit/layer* > 100" in \
        hook.start_line()
    # 30 steps make 10 evaluations, too few for a baseline: the warning says what can still alert
    [message] = hook.unarmed_settings()
    assert "Only non-finite values and the level rules (symptom/max_attn_logit/layer* > 100, armed from the first " \
        "evaluation) can alert" in message
    x = torch.randn(2, 6, 16)
    for step in (1, 2, 3):
        hook.before_step(step)
        model(x)
        hook.after_optimizer_step(step, loss=1.0, grad_norm=1.0, lr=0.1)
    with torch.no_grad():
        per_head = head_maxima(*model.qk(x), 8 ** -0.5)
    [record] = records
    name = f"{MAX_LOGIT_METRIC}/layer0"
    assert record["step"] == 3 and record["metrics"][name] == pytest.approx(max(per_head), rel=1e-5)
    assert max(per_head) > 100 and per_head[1] == max(per_head)
    [alert] = record["alerts"]
    assert (alert["metric"], alert["family"], alert["step"]) == (name, "attention", 3)
    # no optimizer here: the weights never changed (dwq_frozen 1) from the start: a frozen model, not skipped steps
    assert record["metrics"]["attn/layer0/dwq_frozen"] == 1.0
    assert alert["detail"] == {"layer": 0, "head": 1, "level": 100.0, "cause": "logit_growth"}
    arming = hook.arming()
    assert arming["level_rules"] == {"armed_from_step": 3, "rules": ["symptom/max_attn_logit/layer* > 100"]}
    assert arming["armed_from_step"] == 53 * 3 and "level rules (symptom/max_attn_logit/layer* > 100) armed from " \
        "step 3" in arming["note"]
    hook.close()
