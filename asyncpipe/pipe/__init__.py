"""Asynchronous pipeline parallelism: the PipeDream-2BW schedule (pure Python), its DeepSpeed engine subclass, the
two-version weight stash, and `adapter.PipelineEngineAdapter`, a rank's stage as an engine of the run lifecycle
(`asyncpipe.session`). Importing this package does not import deepspeed."""
