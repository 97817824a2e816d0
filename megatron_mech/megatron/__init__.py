"""megatron-core adapter: flags, model discovery, checkpoints, data, MoLS param groups, CPU shims, entry point."""
