"""MoLS's metric names, each written once: the controller (:meth:`~megatron_mech.core.mols.MoLSController.metrics`),
the adapters that add the live multipliers and the metrics reference (``docs/metrics.md``,
:mod:`megatron_mech.records.metrics_reference`) read them from here.

A template holds at most one placeholder: ``{key}``, a measured key (a module class, or a fused-QKV row block), or
``{class}``, a module class. :func:`mols_name` fills it: ``mols_name(SNR, "qk")`` is ``mols/snr/qk``. The names form
the record's ``"mols"`` section (the section's name is their first part).
"""
from __future__ import annotations

__all__ = ["ALPHA", "ALPHA_MEASURED", "ALPHA_RAW", "DIAG_ALPHA", "DIAG_END", "DIAG_SNR", "DONE", "GRAD_SQ", "MULT",
           "SNR", "STATUS", "STATUS_REASON", "TARGET", "TRACE_COV", "WINDOW_OBSERVED", "mols_name"]

SNR = "mols/snr/{key}"
GRAD_SQ = "mols/grad_sq/{key}"
TRACE_COV = "mols/trace_cov/{key}"
ALPHA = "mols/alpha/{class}"
ALPHA_RAW = "mols/alpha_raw/{key}"
ALPHA_MEASURED = "mols/alpha_measured/{class}"
TARGET = "mols/target/{class}"
MULT = "mols/mult/{class}"
DIAG_SNR = "mols/diag_snr/{key}"
DIAG_ALPHA = "mols/diag_alpha/{key}"
DIAG_END = "mols/diag_end"
WINDOW_OBSERVED = "mols/window_observed"
DONE = "mols/done"
STATUS = "mols/status"
STATUS_REASON = "mols/status_reason"


def mols_name(template: str, part: str) -> str:
    """``template`` with its one placeholder replaced by ``part`` (``ValueError`` for a template without one)."""
    head, brace, rest = template.partition("{")
    if not brace:
        raise ValueError(f"MoLS metric name {template!r} has no placeholder to fill")
    return head + str(part) + rest.partition("}")[2]
