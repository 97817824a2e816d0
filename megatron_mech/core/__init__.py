"""The framework-free math core: spectra, weight layouts, sharded spectra, SLQ, router statistics, gradient SNR,
detection, the module taxonomy, MoLS multipliers and alert attribution. Nothing here imports megatron,
deepspeed or transformers (a test enforces it)."""
