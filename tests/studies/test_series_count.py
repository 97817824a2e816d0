"""``benchmarks/series_count.py`` counts what the monitors really name: on a small layout its counts equal the
documented naming (the attention names of ``monitors/attention/names.py``' docstring, the router's 14 routing
summaries + the busiest-expert excess + 3 weight-geometry values per MoE layer, the experts' 2 series per expert + 5
per layer)."""
from __future__ import annotations

import dataclasses

import pytest

from benchmarks import series_count
from benchmarks.frontier_shards import LAYOUTS

pytestmark = pytest.mark.timeout(300)


def test_counts_of_a_small_moe_layout_follow_the_documented_names():
    layout = dataclasses.replace(LAYOUTS["moe"], layers=3, heads=4, experts=6, topk=2)
    result = series_count.count(layout, experts=True)["families"]
    dw, terms = 2 * 6, 3  # ΔW_q, ΔW_k × 6 quantities; Δ1, Δ2, Δ3 per head with a mean and a min per layer
    assert result["attention"] == {"series": 3 * (dw + terms * 2 + terms * 4), "per_unit": 3 * terms * 4,
                                   "other": 3 * (dw + terms * 2), "units": {"head": 3 * terms * 4},
                                   "summary": 3 * (dw + terms * 2) + 3 * terms * 2}  # + head_min, head_mean
    # top-2 of 6 experts: the busiest-expert excess is recorded too
    assert result["router"]["series"] == result["router"]["other"] == 3 * (14 + 1 + 3)
    assert result["experts"] == {"series": 3 * (6 * 2 + 5), "per_unit": 3 * 6 * 2, "other": 3 * 5,
                                 "units": {"e": 3 * 6 * 2}, "summary": 3 * 5 + 3 * 2 * 2}
    # loss, grad norm, skipped optimizer steps (recorded at an evaluation that names skips), the mark of a skipped
    # step, max attention logit, and its 3 layers
    assert result["symptoms"]["series"] == 5 + 3
