"""Our megatron-core entry point (``pretrain_gpt``): its flags, launch helpers and preset, per-rank checkpoints, and
the start-up checks of its run directories and optional sinks."""
