"""Metric-name templates: each monitor family writes its series' names once, as templates in this syntax, and both
the family (filling them with values) and the metrics reference (:mod:`megatron_mech.records.metrics_reference`,
which renders ``docs/metrics.md``) read them.

Syntax: ``{X}`` is a placeholder, ``[...]`` a part present only when all of its placeholders are given (the TP
qualifier ``[/tp{r}]`` of ``--mech-dw-scope slice``). E.g. ``render("attn/layer{L}[/tp{r}]/dwq_entropy", L=3)``
is ``attn/layer3/dwq_entropy``, and with ``r=1`` it is ``attn/layer3/tp1/dwq_entropy``.

The hook's own series (the loss and grad-norm symptoms) are declared here too: they are judged like a monitor's.
"""
from __future__ import annotations

import functools
import re

from megatron_mech.core.diagnosis import STEP_SKIPPED

__all__ = ["SYMPTOM_GRAD_NORM", "SYMPTOM_LOSS", "SYMPTOM_SKIPPED_STEPS", "SYMPTOM_STEP_SKIPPED", "fill", "render"]

SYMPTOM_LOSS = "symptom/loss"
"""The training loss of an evaluation step (or of any step where it is non-finite), as the trainer reports it."""
SYMPTOM_GRAD_NORM = "symptom/grad_norm"
"""The optimizer's global gradient norm of that step."""
SYMPTOM_SKIPPED_STEPS = "symptom/optimizer_steps_skipped"  # counted by megatron_mech.hook.skipped_steps
SYMPTOM_STEP_SKIPPED = STEP_SKIPPED
"""1 on a step the trainer reported its optimizer skipped (absent otherwise); no rule judges it, the diagnosis reads
it: a non-finite grad norm on such a step is why the step was skipped."""

_OPTIONAL = re.compile(r"\[([^\]]*)\]")
_FIELD = re.compile(r"\{(\w+)\}")


@functools.cache
def _format(template: str, with_optional: frozenset) -> str:
    """``template`` as a ``str.format`` pattern: each ``[...]`` part kept (brackets dropped) when its placeholders
    are all in ``with_optional``, removed otherwise."""
    def optional(match):
        part = match.group(1)
        return part if set(_FIELD.findall(part)) <= with_optional else ""
    return _OPTIONAL.sub(optional, template)


def render(template: str, **values) -> str:
    """The concrete name: every placeholder outside ``[...]`` must be given (``ValueError`` naming the missing
    ones); a ``[...]`` part appears when all of its placeholders are given."""
    pattern = _format(template, frozenset(values))
    try:
        return pattern.format(**values)
    except KeyError:
        missing = sorted(set(_FIELD.findall(pattern)) - set(values))
        raise ValueError(f"metric name {template!r}: no value for {missing}") from None


def fill(template: str, **values) -> str:
    """``template`` with the given placeholders replaced and everything else (other placeholders, ``[...]``
    parts) left as it is: a narrower template, e.g. for one quantity of a family's table."""
    return _FIELD.sub(lambda match: str(values[match.group(1)]) if match.group(1) in values else match.group(0),
                      template)
