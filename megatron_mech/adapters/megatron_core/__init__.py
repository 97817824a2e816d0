"""megatron-core adapter: model discovery, master-weight reading, MoLS, the ``--mech-*`` flags on Megatron-LM's
arguments, CPU shims and fixes, and Megatron-LM's callback system onto the hook."""
