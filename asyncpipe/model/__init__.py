"""The GPT model family: a Llama/SmolLM-2 shaped decoder as an ordered list of layers a pipeline can cut."""

from asyncpipe.model.gpt import GPT, Block, Embedding, Head, build_layers, count_parameters, lm_loss
from asyncpipe.model.moe import MoE, Router, moe_layers, pop_moe_stats, pop_moe_sums, set_aux_grad_scale
from asyncpipe.model.partition import layer_of_param, partition, stage_layers

__all__ = [
    "GPT",
    "Block",
    "Embedding",
    "Head",
    "MoE",
    "Router",
    "build_layers",
    "count_parameters",
    "layer_of_param",
    "lm_loss",
    "moe_layers",
    "partition",
    "pop_moe_stats",
    "pop_moe_sums",
    "stage_layers",
    "set_aux_grad_scale",
]
