"""Asynchronous pipeline parallelism: the PipeDream-2BW schedule (pure Python), its DeepSpeed engine subclass, the
two-version weight stash, and `adapter.PipelineEngineAdapter`, a rank's stage as an engine of the run's trainer
(`asyncpipe.trainer`). Importing this package does not import deepspeed."""
