"""Tensors turned into numbers: statistics and sketches, per tensor, a CPU batch at a time, a
device bucket at a time, and per DTensor shard (see probe/capture/__init__.py)."""
