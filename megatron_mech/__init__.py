"""megatron-mech: mechanism-based instability monitors and MoLS for Megatron-LM and DeepSpeed."""
__version__ = "0.1.0"
