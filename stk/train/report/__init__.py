"""What a run reports: metrics.jsonl, TensorBoard or W&B, and the steps that came out non-finite."""
