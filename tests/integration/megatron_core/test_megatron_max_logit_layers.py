"""The per-layer maximum attention logit on a real megatron-core GPTModel (``workers/max_logit_worker.py``): the
adapter's captures feed the recorder, and each layer's maximum and its head equal a dense float64 computation of
every causal q·k from the layers' own ``linear_qkv`` outputs; under TP=2 (heads split over two gloo ranks) the same
model gives the same maxima and the same global heads."""
from __future__ import annotations

import json

import pytest

from dist_utils import WORKERS, run_torchrun
from optional_packages import requires

pytestmark = [pytest.mark.distributed, requires("megatron.core"), pytest.mark.timeout(600)]

NAME = "symptom/max_attn_logit/layer{}"


def _result(tp: int) -> dict:
    out = run_torchrun(WORKERS / "max_logit_worker.py", "--tp", str(tp), nproc=tp, timeout=300).stdout
    [line] = [line for line in out.splitlines() if line.startswith("@@RESULT ")]
    return json.loads(line[len("@@RESULT "):])


@pytest.fixture(scope="module")
def runs():
    return {tp: _result(tp) for tp in (1, 2)}


def test_each_layers_maximum_and_head_equal_a_dense_computation(runs):
    run = runs[1]
    assert run["num_layers"] == 2
    for layer in (0, 1):
        reference = run["reference"][str(layer)]
        # float32 q·k in the recorder vs float64 here, logits of O(10): measured 5e-8 relative
        assert run["metrics"][NAME.format(layer)] == pytest.approx(reference["value"], rel=1e-6)
        assert run["details"][NAME.format(layer)] == {"layer": layer, "head": reference["head"]}
    # the worker scaled the queries of head 1 (layer 0) and head 3 (layer 1): the reference agrees they dominate
    assert [run["reference"][str(layer)]["head"] for layer in (0, 1)] == [1, 3]
    assert run["metrics"]["symptom/max_attn_logit"] == max(run["metrics"][NAME.format(layer)] for layer in (0, 1))


def test_tp2_gives_the_tp1_maxima_and_global_heads(runs):
    # Layer 0's inputs are bit-identical across layouts (the column-parallel QKV splits outputs, no reduction);
    # layer 1's come through the row-parallel projection's all-reduce: float32 reordering, ~1e-7 relative.
    for layer, tol in ((0, 0.0), (1, 1e-6)):
        name = NAME.format(layer)
        assert runs[2]["metrics"][name] == pytest.approx(runs[1]["metrics"][name], rel=tol, abs=0.0)
        assert runs[2]["details"][name] == runs[1]["details"][name]
    assert runs[2]["details"][NAME.format(1)]["head"] == 3  # held by TP rank 1: its head offset counted
