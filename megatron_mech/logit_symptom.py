"""The max-attention-logit symptom series (``symptom/max_attn_logit``): its recorder and monitor family live in
:mod:`megatron_mech.monitors.max_logit`; these names are kept importable from here."""
from megatron_mech.monitors.max_logit import MAX_LOGIT_METRIC, MaxLogitMonitor, MaxLogitRecorder

__all__ = ["MAX_LOGIT_METRIC", "MaxLogitMonitor", "MaxLogitRecorder"]
