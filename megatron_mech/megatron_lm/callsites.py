"""Functions a patched Megatron-LM fork calls (probe)."""
from megatron_mech.megatron_lm import cpu


def on_start():
    cpu.apply_training_cpu_shims()
