"""The GPT model family: a Llama/SmolLM-2 shaped decoder as an ordered list of layers a pipeline can cut."""

from asyncpipe.model.gpt import GPT, Block, Embedding, Head, build_layers, count_parameters, lm_loss
from asyncpipe.model.partition import layer_of_param, partition

__all__ = [
    "GPT",
    "Block",
    "Embedding",
    "Head",
    "build_layers",
    "count_parameters",
    "layer_of_param",
    "lm_loss",
    "partition",
]
