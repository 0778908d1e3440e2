"""How a pipeline cuts the layer list into stages; shared by the pipeline engine and `delay_profile=pipedream`.
The cut itself lives in `asyncpipe.partition` (torch-free); `layer_of_param` maps a parameter to its layer."""

from __future__ import annotations

from asyncpipe.partition import cut_blocks, partition, stage_layers

__all__ = ["cut_blocks", "layer_of_param", "partition", "stage_layers"]


def layer_of_param(name: str) -> int:
    """Index into the layer list of a parameter named ``layers.{i}.…`` (as in `GPT.named_parameters`)."""
    parts = name.split(".")
    if len(parts) < 2 or parts[0] != "layers" or not parts[1].isdigit():
        raise ValueError(f"parameter {name!r} is not inside GPT.layers")
    return int(parts[1])
