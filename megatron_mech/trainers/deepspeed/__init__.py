"""The DeepSpeed reference trainer (``train``): small HF models trained with DeepSpeed and megatron-mech's monitors."""
