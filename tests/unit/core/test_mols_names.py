"""MoLS's metric names are written once, in megatron_mech.core.mols_names: the controller's records use those
templates, and the metrics reference (docs/metrics.md) documents exactly them."""
import re

import pytest

from megatron_mech.core import mols_names
from megatron_mech.core.mols import MoLSConfig, MoLSController
from megatron_mech.records.metrics_reference import METRICS

pytestmark = pytest.mark.timeout(60)

TEMPLATES = {value for name, value in vars(mols_names).items() if name.isupper()}


def pattern(template: str) -> re.Pattern:
    return re.compile(re.sub(r"\\\{\w+\\\}", r"[A-Za-z_]+", re.escape(template)) + "$")


def test_the_reference_documents_exactly_the_templates():
    documented = {entry.name for entry in METRICS if entry.section == "mols"}
    assert documented == TEMPLATES and len(TEMPLATES) == 15


def test_every_name_the_controller_records_is_one_template():
    # a finished window with fixed multipliers and a diagnostic block: every kind of name the controller writes
    snr = {"embedding": 0.01, "qk": 0.02, "vo": 0.04, "mlp": 0.04, "head": 0.04, "norm": 0.04}
    controller = MoLSController(MoLSConfig(window_steps=3, fixed_multipliers={"qk": 2.0}, diagnostic_interval=2),
                                classes_present=tuple(snr))
    trace, small_batch, big_batch = 8.0, 4, 16  # noise-free norms whose two-batch estimate is exactly `snr`
    small = {key: s * trace + trace / small_batch for key, s in snr.items()}
    big = {key: s * trace + trace / big_batch for key, s in snr.items()}
    for step in range(controller.config.window_start, controller.window_end + 1):
        controller.observe(step, small, big, small_batch, big_batch)
    controller.maybe_finalize(controller.window_end)
    for step in range(controller.window_end + 1, controller.window_end + 21):  # past the first diagnostic block
        controller.observe_diagnostic(step, small, big, small_batch, big_batch)
    assert controller.diagnostics
    recorded = controller.metrics(controller.window_end + 21)
    matched = {name: [t for t in TEMPLATES if pattern(t).match(name)] for name in recorded}
    assert all(len(found) == 1 for found in matched.values()), matched
    used = {found[0] for found in matched.values()}
    # status_reason is written only when no α could be formed (tests/unit/core/test_mols.py covers it)
    assert used == TEMPLATES - {mols_names.STATUS_REASON}, TEMPLATES - used


def test_mols_name_fills_the_one_placeholder():
    assert mols_names.mols_name(mols_names.SNR, "qk") == "mols/snr/qk"
    assert mols_names.mols_name(mols_names.MULT, "embedding") == "mols/mult/embedding"
    with pytest.raises(ValueError, match="mols/done"):
        mols_names.mols_name(mols_names.DONE, "qk")
