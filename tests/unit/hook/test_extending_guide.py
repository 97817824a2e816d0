"""The extending guide's example monitor, run verbatim: its code block from ``docs/extending.md`` (the block after
``<!-- example:user-monitor -->``) is executed as the page shows it, registered on a real ``MechHook`` the way the
guide says, and watches a real model trained by a real optimizer. A weight of one layer blown up mid-run (a fault
the loss does not show at once) must raise an alert from the monitor's own rule, under the monitor's name as
family, in the hook, in ``mech.jsonl`` and in the report.

One process, CPU; the model is a small stack of ``torch.nn.Linear`` blocks (the guide's monitor hooks any module
list), the hook writes through its own sinks."""
from __future__ import annotations

import re

import pytest
import torch

from megatron_mech.config import DetectorOverrides, MechConfig, MonitorConfig, OutputConfig
from megatron_mech.hook import MechHook
from megatron_mech.model_view import ModelView
from megatron_mech.records.report import summarize_run
from megatron_mech.records.sinks import JSONL_NAME, read_jsonl
from readme_blocks import REPO_ROOT

pytestmark = pytest.mark.timeout(300)

WIDTH, LAYERS, BATCH = 16, 3, 32
INTERVAL, STEPS, FAULT_STEP, FAULT_LAYER = 2, 24, 16, 1


def guide_block(marker: str) -> str:
    """The ``python`` block right after ``<!-- marker -->`` in docs/extending.md, as the page shows it."""
    text = (REPO_ROOT / "docs" / "extending.md").read_text(encoding="utf-8")
    match = re.search(rf"<!-- {re.escape(marker)} -->\n```python\n(.*?)```", text, flags=re.S)
    assert match, f"docs/extending.md has no ```python block after <!-- {marker} -->"
    return match.group(1)


def guide_monitor_class():
    namespace: dict = {}
    exec(compile(guide_block("example:user-monitor"), "docs/extending.md", "exec"), namespace)
    return namespace["ActivationNorms"]


def _train(tmp_path):
    """Train the model ``STEPS`` steps with the guide's monitor registered; at ``FAULT_STEP`` the weight of layer
    ``FAULT_LAYER`` is scaled by 20 before the forward pass (its output, and every layer's after it, rises at
    once). Returns the hook (closed) and the records of ``mech.jsonl``."""
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh())
                                 for _ in range(LAYERS))
    optimizer = torch.optim.AdamW(layers.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(1)
    inputs, targets = torch.randn(BATCH, WIDTH, generator=data), torch.randn(BATCH, WIDTH, generator=data)
    config = MechConfig(monitors=MonitorConfig(interval=INTERVAL),
                        detector=DetectorOverrides(warmup=0, baseline=3, persistence=1),
                        output=OutputConfig(dir=str(tmp_path)))
    hook = MechHook(config, train_steps=STEPS)
    hook.add_monitor(guide_monitor_class()([layer[0] for layer in layers]))  # the guide's registration call
    hook.setup(ModelView(), optimizer)
    for step in range(1, STEPS + 1):
        hook.before_step(step)
        if step == FAULT_STEP:
            with torch.no_grad():
                layers[FAULT_LAYER][0].weight.mul_(20.0)
        hidden = inputs
        for layer in layers:
            hidden = layer(hidden)
        loss = torch.nn.functional.mse_loss(hidden, targets)
        optimizer.zero_grad()
        loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(layers.parameters(), float("inf")))
        optimizer.step()
        hook.after_optimizer_step(step, loss=loss.item(), grad_norm=grad_norm, lr=1e-3)
    hook.close()
    return hook, read_jsonl(tmp_path / JSONL_NAME)


def test_the_guides_example_monitor_raises_an_alert_from_its_own_rule_under_its_name(tmp_path):
    hook, records = _train(tmp_path)
    assert "activation_norms" in [m.name for m in hook.monitors]
    ours = [a for a in hook.alerts if a.family == "activation_norms"]
    assert ours, f"no alert from the monitor's rule; alerts: {[a.describe() for a in hook.alerts]}"
    first = ours[0]
    # the blown-up layer alerts at the first evaluation that sees it, and nothing of the monitor's alerted before
    assert (first.metric, first.step, first.detail["layer"]) == (f"act/layer{FAULT_LAYER}/rms", FAULT_STEP,
                                                                 FAULT_LAYER)
    assert first.value > 5 * first.baseline  # far above its own healthy baseline, read from the records below
    healthy = [r["metrics"][first.metric] for r in records if r["step"] < FAULT_STEP and "metrics" in r
               and first.metric in r["metrics"]]
    assert len(healthy) == FAULT_STEP // INTERVAL - 1 and max(healthy) < 1.5 * min(healthy)
    assert first.baseline == pytest.approx(sorted(healthy[:3])[1])  # the median of its 3 baseline evaluations
    # the record of truth carries it under the monitor's family, and the report counts it
    recorded = [a for r in records for a in r.get("alerts", ()) if a["metric"] == first.metric]
    assert recorded[0]["family"] == "activation_norms" and recorded[0]["step"] == FAULT_STEP
    report = summarize_run(records)
    assert re.search(r"- \*\*Alerts:\*\* \d+ \(attention 0, router 0, symptom \d+, activation_norms \d+\)", report)
    assert f"- **activation_norms:** [activation_norms] act/layer{FAULT_LAYER}/rms at step {FAULT_STEP}" in report
