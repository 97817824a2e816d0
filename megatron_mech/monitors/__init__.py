"""Framework-free monitors: they take tensors (and an optional process group) and produce named metrics."""
from megatron_mech.monitors.attention import AttentionEvaluator, AttentionLayer, AttentionMonitorConfig

__all__ = ["AttentionLayer", "AttentionEvaluator", "AttentionMonitorConfig"]
