"""megatron-core adapter: flags, model discovery, checkpoints, data, MoLS, CPU shims and fixes, the entry point, and
Megatron-LM's callback system onto the hook."""
