"""Records: output sinks (JSONL, TensorBoard, W&B, DeepSpeed monitor), the run report, and the one-run-per-directory
rule the entry points apply before training."""
