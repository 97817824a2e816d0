"""The max-attention-logit symptom: the core function against a dense per-pair loop, and the hook's recorder
through a real (framework-free) attention layer whose inputs it captures on evaluation steps only."""
from __future__ import annotations

import math

import pytest
import torch

from megatron_mech.config import DetectorOverrides, MechConfig, MonitorConfig
from megatron_mech.core.attention_logits import max_attention_logit, max_attention_logit_per_head
from megatron_mech.hook import MechHook
from megatron_mech.monitors.max_logit import MAX_LOGIT_METRIC
from megatron_mech.model_view import ModelView
from megatron_mech.monitors.attention import AttentionLayer
from megatron_mech.records.sinks import CallbackSink


def loop_reference(q, k, scale, causal, mask=None):
    """Pair by pair, in float64: the definition."""
    b, h, sq, d = q.shape
    g, sk = k.shape[1], k.shape[2]
    best = -math.inf
    for bi in range(b):
        for hi in range(h):
            for i in range(sq):
                for j in range(sk):
                    if causal and j > i + (sk - sq):
                        continue
                    if mask is not None and bool(mask[bi, 0, i, j]):
                        continue
                    best = max(best, float((q[bi, hi, i].double() @ k[bi, hi // (h // g), j].double()) * scale))
    return best


@pytest.mark.parametrize("h,g,causal", [(4, 4, True), (4, 2, True), (4, 1, False)])
def test_matches_the_pairwise_definition(h, g, causal):
    gen = torch.Generator().manual_seed(h * 10 + g)
    q = torch.randn(2, h, 9, 8, generator=gen)
    k = torch.randn(2, g, 9, 8, generator=gen)
    k[1, 0, 8] *= 6  # a large logit on the last key: only visible to the last query when causal
    got = max_attention_logit(q, k, 0.35, causal=causal)
    assert got == pytest.approx(loop_reference(q, k, 0.35, causal), rel=1e-5)  # float32 vs float64


def test_mask_nan_and_bad_shapes():
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 2, 5, 4, generator=gen), torch.randn(1, 2, 5, 4, generator=gen)
    mask = torch.zeros(1, 1, 5, 5, dtype=torch.bool)
    mask[..., 0] = True  # key 0 hidden from every query
    assert max_attention_logit(q, k, 1.0, causal=False, mask=mask) == pytest.approx(
        loop_reference(q, k, 1.0, False, mask), rel=1e-5)
    assert max_attention_logit(q, k, 1.0, causal=True, mask=mask) == pytest.approx(
        loop_reference(q, k, 1.0, True, mask), rel=1e-5)
    q_nan = q.clone()
    q_nan[0, 1, 3, 0] = math.nan
    assert math.isnan(max_attention_logit(q_nan, k, 1.0))
    with pytest.raises(ValueError, match="key"):
        max_attention_logit(q, torch.randn(1, 3, 5, 4), 1.0)
    with pytest.raises(ValueError, match="query and key"):
        max_attention_logit(q[0], k[0], 1.0)


class TinyAttention(torch.nn.Module):
    """One causal self-attention layer with a fused QKV weight, reporting its q, k to a capture hook."""

    def __init__(self, d_model=16, heads=2, head_dim=8):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.qkv = torch.nn.Linear(d_model, 3 * heads * head_dim, bias=False)
        self.record = None

    def forward(self, x):  # x [b, s, d_model]
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        if self.record is not None:
            self.record(0, q, k, self.head_dim ** -0.5, True)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_hook_records_the_maximum_on_evaluation_steps_only():
    torch.manual_seed(0)
    model = TinyAttention()
    weight = model.qkv.weight
    view = ModelView(attention_layers=[AttentionLayer(0, weight, 2, 2, 8)],
                     attention_logit_capture=[lambda record: setattr(model, "record", record)])
    records = []
    config = MechConfig(monitors=MonitorConfig(families=("attention",), interval=3, qk_terms=("delta2",)),
                        detector=DetectorOverrides(warmup=0, baseline=3, persistence=1))
    hook = MechHook(config, sinks=CallbackSink(records.append))
    hook.setup(view, None)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    expected = {}
    for step in range(1, 10):
        hook.before_step(step)
        batches = [torch.randn(2, 6, 16) for _ in range(2)]  # two micro-batches: the maximum covers both
        for x in batches:
            model(x).square().mean().backward()
        with torch.no_grad():
            b, s = 2, 6
            ref = max(max_attention_logit(*model.qkv(x).view(b, s, 3, 2, 8).permute(2, 0, 3, 1, 4)[:2],
                                          8 ** -0.5) for x in batches)
        opt.step()
        opt.zero_grad()
        if step % 3 == 0:
            expected[step] = ref
        hook.after_optimizer_step(step, loss=1.0, grad_norm=1.0, lr=0.1)
    got = {r["step"]: r["metrics"][MAX_LOGIT_METRIC] for r in records}
    assert got.keys() == expected.keys() == {3, 6, 9}
    for step in got:
        assert got[step] == pytest.approx(expected[step], rel=1e-6)
    assert MAX_LOGIT_METRIC not in [d.metric for d in hook.registry.detectors.values()]  # logged, not alerted on
    hook.close()


def test_chunked_rows_give_the_same_maximum(monkeypatch):
    # Long sequences are processed in query-row chunks; force tiny chunks and compare with one chunk.
    import megatron_mech.core.attention_logits as AL

    gen = torch.Generator().manual_seed(5)
    q, k = torch.randn(2, 4, 33, 8, generator=gen), torch.randn(2, 2, 33, 8, generator=gen)
    mask = torch.rand(2, 1, 33, 33, generator=gen) < 0.3
    whole = AL.max_attention_logit(q, k, 0.3, causal=True, mask=mask)
    monkeypatch.setattr(AL, "CHUNK_ELEMENTS", 2 * 4 * 33 * 5)  # 5 query rows per chunk
    # a different matmul shape may sum the 8 products in another order: float32 rounding only
    assert AL.max_attention_logit(q, k, 0.3, causal=True, mask=mask) == pytest.approx(whole, rel=1e-6)
    assert whole == pytest.approx(loop_reference(q, k, 0.3, True, mask), rel=1e-5)


def loop_reference_per_head(q, k, scale, causal, mask=None):
    """Pair by pair, in float64, one maximum per query head (the definition)."""
    return [loop_reference(q[:, [hi]], k[:, [hi // (q.shape[1] // k.shape[1])]], scale, causal, mask)
            for hi in range(q.shape[1])]


@pytest.mark.parametrize("h,g,causal", [(4, 4, True), (4, 2, True), (4, 1, False)])
def test_per_head_maxima_match_the_pairwise_definition(h, g, causal):
    gen = torch.Generator().manual_seed(h * 10 + g + 1)
    q = torch.randn(2, h, 9, 8, generator=gen)
    k = torch.randn(2, g, 9, 8, generator=gen)
    q[0, h - 1] *= 5  # the last head holds the largest logits
    mask = torch.rand(2, 1, 9, 9, generator=gen) < 0.2
    got = max_attention_logit_per_head(q, k, 0.35, causal=causal, mask=mask)
    assert got.dtype == torch.float64 and got.shape == (h,)
    # float32 products vs the float64 loop: ~1e-7 relative, 1e-5 leaves room for the summation order
    assert got.tolist() == pytest.approx(loop_reference_per_head(q, k, 0.35, causal, mask), rel=1e-5)
    assert float(got.max()) == pytest.approx(max_attention_logit(q, k, 0.35, causal=causal, mask=mask), rel=1e-6)


def test_per_head_nan_stays_in_its_head_and_a_fully_masked_head_is_minus_inf(monkeypatch):
    import megatron_mech.core.attention_logits as AL

    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(1, 3, 6, 4, generator=gen), torch.randn(1, 3, 6, 4, generator=gen)
    q[0, 1, 5, 0] = math.nan  # the last query row of head 1: its NaN is in a later chunk than the first rows
    monkeypatch.setattr(AL, "CHUNK_ELEMENTS", 3 * 6 * 2)  # 2 query rows per chunk
    got = AL.max_attention_logit_per_head(q, k, 1.0, causal=True)
    assert math.isnan(got[1]) and not math.isnan(got[0]) and not math.isnan(got[2])
    assert got[0] == pytest.approx(loop_reference(q[:, [0]], k[:, [0]], 1.0, True), rel=1e-5)
    everything = torch.ones(1, 1, 6, 6, dtype=torch.bool)
    assert AL.max_attention_logit_per_head(q[:, [0]], k[:, [0]], 1.0, causal=False, mask=everything).tolist() == [
        -math.inf]
