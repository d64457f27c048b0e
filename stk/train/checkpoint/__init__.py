"""Checkpoints: the files of one (store), when the loop saves and what beside DeepSpeed's (checkpointer), their digests,
and resuming on another number of ranks (worldsize)."""
