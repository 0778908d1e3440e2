"""Asynchronous pipeline parallelism: the PipeDream-2BW schedule (pure Python), its DeepSpeed engine subclass,
the two-version weight stash and the per-rank runner. Importing this package does not import deepspeed."""
