"""The pipeline runtime (`engine=pipeline`): DeepSpeed's engine subclass running a declared schedule (with its p2p,
weight stash, clock), DualPipeV's subclass, PyTorch's own schedules (`torch_engine`), and
`adapter.PipelineEngineAdapter`, a rank's stage as an engine of the run's trainer (`asyncpipe.trainer`). Importing
this package does not import deepspeed."""
