"""The single-process training loop (`engine=simulate`): steps, evaluation, divergence, checkpoints."""
