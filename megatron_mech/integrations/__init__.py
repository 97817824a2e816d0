"""Thin framework adapters (megatron-core, Megatron-LM patch, DeepSpeed). The math lives one level up."""
