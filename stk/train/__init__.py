"""stk-train: fine-tuning from a cache built by stk-cache (see stk/shards/reader.py)."""
