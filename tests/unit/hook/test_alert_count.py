"""The entry point's closing ``[train] done:`` line counts the alerts in the unit the console showed them: its
``[mech] ALERT`` lines, collected from the real hook's log on a run whose loss jumps (several series alert at one
step, then on later evaluations), plus the alerting series behind them."""
from __future__ import annotations

import logging
import re

from optional_packages import requires
from test_hook import SPIKE, _config, _loss, _Run, _update


@requires("megatron.core")
def test_the_done_line_counts_the_alert_lines_the_console_showed():
    from megatron_mech.trainers.megatron_core.pretrain_gpt import _alert_count

    shown = []

    class _Collect(logging.Handler):
        def emit(self, record):
            if "[mech] ALERT" in record.getMessage():
                shown.append(record.getMessage())

    handler = _Collect(level=logging.INFO)
    logger = logging.getLogger("megatron_mech")
    logger.addHandler(handler)
    previous = logger.level
    logger.setLevel(logging.INFO)
    try:
        run = _Run(_config())
        for step in range(1, SPIKE + 8):  # a non-finite loss and grad norm at step 9 (two series, one line), then
            run.hook.before_step(step)     # the loss jump from SPIKE
            _update(run.weight, step)
            blown = step == 9
            run.hook.after_optimizer_step(step, loss=float("nan") if blown else _loss(step),
                                          grad_norm=float("inf") if blown else 1.0, lr=1e-3)
        run.hook.close()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous)
    alerts = run.hook.alerts
    assert len(shown) >= 1 and len(alerts) > len(shown), (shown, alerts)  # more series than lines
    lines = f"{len(shown)} ALERT line{'s' if len(shown) != 1 else ''}"
    assert _alert_count(alerts) == f"{lines} ({len(alerts)} alerting series)"
    assert re.fullmatch(r"no alerts", _alert_count([]))
