"""The metrics reference (``megatron_mech.records.metrics_reference``, ``docs/metrics.md``) against what really gets
recorded: the names of a real megatron-core run with every optional series switched on, plus the attention monitor
in slice scope, must each match exactly one documented pattern; every documented pattern must be recorded by one
of them unless it needs a flag they did not set; the alert columns must be what the detector registry does with
each name; the committed page must be the generated one."""
from __future__ import annotations

import json

import pytest
import torch

from dist_utils import REPO_ROOT, run_torchrun
from megatron_mech.cli import main as cli_main
from megatron_mech.core.detect import DetectorConfig, DetectorRegistry, SeriesRule
from megatron_mech.monitors.registry import default_registry
from megatron_mech.monitors.attention import AttentionLayer, AttentionEvaluator, AttentionMonitorConfig
from megatron_mech.records.metrics_reference import (METRICS, RECORD_FIELDS, SLICE_SCOPE_FLAG, alert_rule, entry_for,
                                                     render_markdown)

LAUNCHER = REPO_ROOT / "launch_scripts" / "pretrain_gpt_mech.py"
# One process, one MoE layer, one evaluation (step 5): the smallest run that records every series family.
# Two micro-batches per step give MoLS's two-batch estimator its small/big batch pair; the window (steps 1–3) and
# a one-step diagnostic block close before the evaluation. The base class is the embedding, whose 3-step SNR is
# well above zero (0.05–0.1 measured), so raw α exist; the default base (vo) can come out S = 0 from noise here.
TINY_EVERYTHING = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--ffn-hidden-size", "64",
                   "--seq-length", "32", "--micro-batch-size", "1", "--global-batch-size", "2", "--lr", "2e-3",
                   "--min-lr", "2e-4", "--lr-warmup-iters", "2", "--log-interval", "5", "--eval-iters", "1",
                   "--mech-interval", "5", "--seed", "11", "--num-experts", "2", "--moe-router-topk", "2",
                   "--train-iters", "5", "--mech-all-linears", "--mech-experts", "--mech-mols", "--mech-mols-window",
                   "3", "--mech-mols-base", "embedding", "--mech-mols-diagnostic-interval", "1",
                   "--mech-mols-diagnostic-steps", "1", "--mech-mols-fixed", "embedding=1.5"]
# The flags the two sources below exercise (a documented name needing any other flag may go unrecorded).
EXERCISED_FLAGS = {"--mech-all-linears", "--mech-experts", "--mech-mols", "--mech-mols-fixed",
                   "--mech-mols-diagnostic-interval", SLICE_SCOPE_FLAG}


def _slice_scope_names() -> set:
    """Names of the real attention monitor in slice scope (one TP shard, no process group): one evaluation of a
    fused QKV weight and a dense linear named as the megatron-core adapter names them."""
    gen = torch.Generator().manual_seed(0)
    heads, groups, head_dim, d_model = 2, 1, 8, 16
    qkv = torch.randn((heads + 2 * groups) * head_dim, d_model, generator=gen)
    proj = torch.randn(d_model, heads * head_dim, generator=gen)
    monitor = AttentionEvaluator([AttentionLayer(0, qkv, heads, groups, head_dim)],
                               AttentionMonitorConfig(interval=1, dw_scope="slice"),
                               extra_linears={"layer0/linear_proj": (proj, 1)})
    monitor.observe(0)
    with torch.no_grad():
        qkv += 1e-2 * torch.randn(qkv.shape, generator=gen)
        proj += 1e-2 * torch.randn(proj.shape, generator=gen)
    metrics, _ = monitor.observe(1)
    return set(metrics)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> dict:
    run_dir = tmp_path_factory.mktemp("metrics_reference") / "run"
    run_torchrun(LAUNCHER, *TINY_EVERYTHING, "--save", str(run_dir), nproc=1, timeout=300)
    records = [json.loads(line) for line in (run_dir / "mech.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [5]
    return {"metrics": {n for r in records for n in r["metrics"]},
            "mols": {n for r in records for n in r.get("mols") or {}},
            "slice": _slice_scope_names(),
            "fields": {k for r in records for k in r},
            "records": records}


def _sections(recorded: dict) -> dict:
    return {"metrics": recorded["metrics"] | recorded["slice"], "mols": recorded["mols"]}


@pytest.mark.slow
@pytest.mark.distributed
def test_every_recorded_name_matches_exactly_one_documented_pattern(recorded):
    assert any(n.startswith("attn/layer0/tp0/") for n in recorded["slice"])  # the slice scope was exercised
    for section, names in _sections(recorded).items():
        assert names
        for name in sorted(names):
            matches = entry_for(name)
            assert len(matches) == 1, (name, [e.name for e in matches])
            assert matches[0].section == section, (name, matches[0].name)


@pytest.mark.slow
@pytest.mark.distributed
def test_every_documented_pattern_is_recorded_or_needs_a_flag_not_run(recorded):
    sections = _sections(recorded)
    unrecorded = []
    for entry in METRICS:
        for optional, flags in entry.variants():
            pattern = entry.regex(optional)
            if not any(pattern.fullmatch(n) for n in sections[entry.section]):
                unrecorded.append((entry.name, optional, flags))
    # every documented name is recorded here; one that is not must name a flag these runs did not set, or be
    # one that only a failed estimate writes (test_mols.py's negative-base test records it)
    only_on_failure = {"mols/status_reason"}
    # the run routes top-2 of 2 experts: every expert is in every top-k, so there is no busiest-expert excess
    only_with_topk_below_experts = {"router/layer{L}/expert_share_excess"}
    # recorded only after (and on) a skipped optimizer step (tests/integration/deepspeed/test_skipped_steps.py
    # records both)
    only_after_a_skipped_step = {"symptom/optimizer_steps_skipped", "symptom/optimizer_step_skipped"}
    assert all(set(flags) - EXERCISED_FLAGS
               or name in only_on_failure | only_with_topk_below_experts | only_after_a_skipped_step
               for name, _, flags in unrecorded), unrecorded


@pytest.mark.slow
@pytest.mark.distributed
def test_alert_columns_are_what_the_registry_does_with_each_name(recorded):
    names = sorted(recorded["metrics"] | recorded["slice"])
    registry = default_registry()  # the hook's rules: default_rules(), no --mech-detector-* overrides
    registry.update(1, {n: 0.5 for n in names})  # which rule judges a series depends on its name only
    alerted = 0
    for name in names:
        rule = alert_rule(entry_for(name)[0])
        if name in registry.detectors:
            detector = registry.detectors[name]
            assert rule is not None, name
            assert (detector.family, detector.config) == (rule.family, rule.config(DetectorConfig())), name
            alerted += 1
        else:
            assert name in registry.unmonitored and rule is None, (name, rule)
    assert alerted >= 10  # per-head Δ2, ΔW of Q and K, router entropies and cosine, loss, grad norm
    for entry in METRICS:  # MoLS series never reach the detectors: documented as logged only
        if entry.section == "mols":
            assert alert_rule(entry) is None


def test_an_entry_split_by_the_rules_is_refused():
    entry = next(e for e in METRICS if e.name.endswith("/dw{m}_entropy"))
    with pytest.raises(ValueError, match="spans several detector rules"):
        alert_rule(entry, rules=[SeriesRule("attn/layer1/*", "attention")])


@pytest.mark.slow
@pytest.mark.distributed
def test_record_fields_are_documented(recorded):
    assert recorded["fields"] <= {f.key for f in RECORD_FIELDS}, recorded["fields"]


def test_committed_page_is_the_generated_reference(tmp_path):
    text = render_markdown()
    assert (REPO_ROOT / "docs" / "metrics.md").read_text(encoding="utf-8") == text, (
        "docs/metrics.md is stale: regenerate it with `megatron-mech metrics --output docs/metrics.md`")
    out = tmp_path / "metrics.md"
    assert cli_main(["metrics", "--output", str(out)]) == 0
    assert out.read_text(encoding="utf-8") == text
    assert cli_main(["metrics", "--output", str(tmp_path / "missing" / "metrics.md")]) == 2


def test_the_skipped_steps_entry_states_the_share_that_alerts():
    """The page said any skipped step raised an alert; the hook alerts only when at least ALERT_SHARE of an
    interval's steps were skipped (and never on a loss scaler's start-up skips)."""
    from megatron_mech.hook.skipped_steps import ALERT_SHARE, SKIPPED_METRIC

    assert ALERT_SHARE == 0.5  # the wording below names the share; change both together
    [entry] = entry_for(SKIPPED_METRIC)
    text = entry.meaning
    assert "at least half of the steps since the previous one" in text and "Any skipped step" not in text
    assert "start-up search" in text and "never alerted" in text
