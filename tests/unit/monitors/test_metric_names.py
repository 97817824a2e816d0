"""A metric's name is written once, as a template beside the monitor that records it
(:mod:`megatron_mech.monitors.metric_names` syntax); the monitors fill the templates, and the metrics reference
(docs/metrics.md) is built from the same templates, spelling no series name of its own."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from dist_utils import REPO_ROOT
from megatron_mech.monitors.attention.names import unit_entries
from megatron_mech.monitors.metric_names import fill, render

pytestmark = pytest.mark.timeout(60)

SERIES_PREFIXES = ("attn/", "linear/", "router/", "expert/", "symptom/")


def test_render_keeps_an_optional_part_only_when_its_placeholders_are_given():
    template = "attn/layer{L}[/tp{r}]/dw{m}_entropy"
    assert render(template, L=3, m="q") == "attn/layer3/dwq_entropy"
    assert render(template, L=3, m="k", r=1) == "attn/layer3/tp1/dwk_entropy"
    with pytest.raises(ValueError, match=r"no value for \['m'\]"):
        render(template, L=3)
    assert fill(template, m="q") == "attn/layer{L}[/tp{r}]/dwq_entropy"  # the reference's narrower template


def test_attention_names_are_those_the_records_have_always_held():
    # written out by hand from the record layout (docs/metrics.md), not from the templates
    names = [name for name, _, _ in unit_entries("layer", 3, terms=("delta2",), heads=range(1), tp_rank=None)]
    assert names == [*(f"attn/layer3/dw{m}_{q}" for m in "qk" for q in ("entropy", "effective_rank", "stable_rank",
                                                                         "fro", "frozen", "update_ratio")),
                     "attn/layer3/delta2_entropy_mean", "attn/layer3/delta2_entropy_min",
                     "attn/layer3/head0/delta2_entropy"]
    sliced = [name for name, _, _ in unit_entries("layer", 3, terms=("delta2",), heads=range(1), tp_rank=1)]
    assert sliced[0] == "attn/layer3/tp1/dwq_entropy" and sliced[12] == "attn/layer3/tp1/delta2_entropy_mean"
    assert sliced[14] == "attn/layer3/head0/delta2_entropy"  # per-head names carry global heads, no TP tag
    assert unit_entries("extra", "layer0/linear_fc1", tp_rank=0)[0][0] == "linear/layer0/linear_fc1/tp0/dw_entropy"


def series_literals(path: Path) -> list:
    """String constants in ``path`` that spell a series name (a prefix followed by more than the prefix)."""
    return [node.value for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and any(node.value.startswith(p) and len(node.value) > len(p) for p in SERIES_PREFIXES)]


def test_the_metrics_reference_spells_no_series_name_of_its_own():
    assert series_literals(REPO_ROOT / "megatron_mech" / "records" / "metrics_reference.py") == []


def test_the_scan_finds_a_name_written_by_hand(tmp_path):
    planted = tmp_path / "reference.py"
    planted.write_text('ENTRY = ("router/layer{L}/load_cv", "meaning")\nGROUP = ("Router", "router/")\n')
    assert series_literals(planted) == ["router/layer{L}/load_cv"]
