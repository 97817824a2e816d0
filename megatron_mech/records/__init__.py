"""Records: output sinks (JSONL, TensorBoard, W&B, DeepSpeed monitor) and the run report."""
