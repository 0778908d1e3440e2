"""asyncpipe: asynchronous (PipeDream-2BW) pipeline-parallel pretraining research tool."""

__version__ = "0.1.0"
