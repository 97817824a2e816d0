"""MetricExchange (megatron_mech.core.metric_exchange): per-rank metric dicts merged by one fixed-size SUM
all-reduce, checked against the union computed directly, under torchrun with 3 gloo ranks."""
from __future__ import annotations


import pytest

from dist_utils import WORKERS, run_torchrun
from megatron_mech.core.metric_exchange import MetricExchange


def test_single_process_is_identity():
    metrics, details = MetricExchange().combine({"a": 1.0}, {"a": {"layer": 0}})
    assert metrics == {"a": 1.0} and details == {"a": {"layer": 0}}


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_three_ranks_merge_exactly():
    result = run_torchrun(WORKERS / "metric_exchange_worker.py", nproc=3, timeout=180)
    assert "METRIC_EXCHANGE PASS" in result.stdout, result.stdout[-4000:]
