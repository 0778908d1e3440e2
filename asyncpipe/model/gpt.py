"""A GPT in the Llama / SmolLM-2 shape (RMSNorm, RoPE, SwiGLU, grouped-query attention, optional tied
embeddings), written as an ordered list of one-tensor-in, one-tensor-out layers so that a pipeline can cut it.

Each layer is initialised from its own generator seeded by (seed, layer index): a model built whole and a model
built stage by stage get bit-identical weights, which is what makes loss parity between engines possible.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from asyncpipe.model.init import layer_generator, normal_
from asyncpipe.model.moe import MoE


class Embedding(nn.Module):
    """Token ids [B, T] -> hidden states [B, T, D]."""

    def __init__(self, vocab_size: int, d_model: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, d_model))

    def init_weights(self, std: float, gen: torch.Generator) -> None:
        normal_(self.weight, std, gen)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


def _rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary position embedding over the last dim of x [B, H, T, Dh] (rotate-half convention)."""
    t, dh = x.shape[-2], x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, dh, 2, device=x.device, dtype=torch.float32) / dh))
    angles = torch.outer(torch.arange(t, device=x.device, dtype=torch.float32), inv_freq)
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1).to(x.dtype)
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1).to(x.dtype)
    x1, x2 = x[..., : dh // 2], x[..., dh // 2 :]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Block(nn.Module):
    """Pre-norm transformer block: causal GQA attention with RoPE, then a SwiGLU MLP or a mixture of SwiGLU
    experts (`MoE`). Its 2-D weights and its experts' matrices are the 'hidden matrices' that Muon optimises."""

    def __init__(
        self,
        d_model: int,
        n_head: int,
        n_kv_head: int,
        d_ff: int,
        rope_theta: float,
        eps: float,
        moe: Optional[MoE] = None,
    ):
        super().__init__()
        if d_model % n_head or n_head % n_kv_head:
            raise ValueError(f"d_model {d_model}, n_head {n_head}, n_kv_head {n_kv_head} do not divide evenly")
        self.n_head, self.n_kv_head, self.head_dim = n_head, n_kv_head, d_model // n_head
        self.rope_theta = rope_theta
        self.attn_norm = nn.RMSNorm(d_model, eps=eps)
        self.q = nn.Linear(d_model, d_model, bias=False)
        self.k = nn.Linear(d_model, n_kv_head * self.head_dim, bias=False)
        self.v = nn.Linear(d_model, n_kv_head * self.head_dim, bias=False)
        self.o = nn.Linear(d_model, d_model, bias=False)
        self.mlp_norm = nn.RMSNorm(d_model, eps=eps)
        self.moe = moe  # a mixture of experts in place of the dense MLP
        if moe is None:
            self.gate = nn.Linear(d_model, d_ff, bias=False)
            self.up = nn.Linear(d_model, d_ff, bias=False)
            self.down = nn.Linear(d_ff, d_model, bias=False)

    def init_weights(self, std: float, out_std: float, gen: torch.Generator) -> None:
        dense = self.moe is None
        for lin in (self.q, self.k, self.v) + ((self.gate, self.up) if dense else ()):
            normal_(lin.weight, std, gen)
        for lin in (self.o,) + ((self.down,) if dense else ()):  # residual-branch outputs: scaled with depth (GPT-2)
            normal_(lin.weight, out_std, gen)
        if self.moe is not None:
            self.moe.init_weights(std, out_std, gen)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, d = h.shape
        x = self.attn_norm(h)
        q = self.q(x).view(b, t, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k(x).view(b, t, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, t, self.n_kv_head, self.head_dim).transpose(1, 2)
        q, k = _rope(q, self.rope_theta), _rope(k, self.rope_theta)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv_head != self.n_head)
        h = h + self.o(y.transpose(1, 2).reshape(b, t, d))
        x = self.mlp_norm(h)
        if self.moe is not None:
            return h + self.moe(x)
        return h + self.down(F.silu(self.gate(x)) * self.up(x))


class Head(nn.Module):
    """Final RMSNorm and the output projection: hidden [B, T, D] -> logits [B, T, V]."""

    tied_copy = False  # True: its own copy of a tied embedding held on another rank (`build_layers`)

    def __init__(self, d_model: int, vocab_size: int, eps: float, tied_to: Optional[Embedding] = None):
        super().__init__()
        self.norm = nn.RMSNorm(d_model, eps=eps)
        # A tied head reads the embedding's weight; it owns no parameter of its own.
        self.tied_to = [tied_to] if tied_to is not None else None
        self.weight = None if tied_to is not None else nn.Parameter(torch.empty(vocab_size, d_model))

    def init_weights(self, std: float, gen: torch.Generator) -> None:
        if self.weight is not None:
            normal_(self.weight, std, gen)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        weight = self.tied_to[0].weight if self.tied_to is not None else self.weight
        return F.linear(self.norm(h), weight)


def build_layers(cfg: Any, vocab_size: int, seed: int = 0, indices: Optional[Iterable[int]] = None) -> list[nn.Module]:
    """``[Embedding, Block x n_layer, Head]`` for a `ModelConfig`-shaped cfg, each initialised from (seed, index).

    ``indices`` builds only those layers (a pipeline stage); the others are ``None`` placeholders. A tied head
    built without its embedding (the last stage of a pipeline) holds a copy of the embedding's matrix, initialised
    as the embedding is, and is marked ``tied_copy`` (the engine sums the two copies' gradients:
    `engines.pipeline.tied`).
    """
    n = cfg.n_layer
    total = n + 2
    wanted = set(range(total)) if indices is None else set(indices)
    n_kv = cfg.n_kv_head or cfg.n_head
    std, out_std = cfg.init_std, cfg.init_std / math.sqrt(2 * n)
    layers: list[Optional[nn.Module]] = [None] * total
    for i in sorted(wanted):
        gen = layer_generator(seed, i)
        if i == 0:
            layer: nn.Module = Embedding(vocab_size, cfg.d_model)
            layer.init_weights(std, gen)
        elif i == total - 1:
            tied = layers[0] if cfg.tie_embeddings else None
            layer = Head(cfg.d_model, vocab_size, cfg.norm_eps, tied_to=tied)
            copy = cfg.tie_embeddings and tied is None  # the embedding lives elsewhere: a copy of its initial matrix
            layer.init_weights(std, layer_generator(seed, 0) if copy else gen)
            layer.tied_copy = copy
        else:
            layer = Block(cfg.d_model, cfg.n_head, n_kv, cfg.d_ff, cfg.rope_theta, cfg.norm_eps, moe=_moe(cfg))
            layer.init_weights(std, out_std, gen)
        layers[i] = layer
    return layers  # type: ignore[return-value]


def _moe(cfg: Any) -> Optional[MoE]:
    moe = getattr(cfg, "moe", None)
    if moe is None or not moe.experts:
        return None
    return MoE(
        cfg.d_model,
        moe.d_expert or cfg.d_ff,
        moe.experts,
        moe.top_k,
        moe.shared_expert,
        moe.aux_loss_coef,
        moe.z_loss_coef,
        moe.capacity_factor,
    )


class GPT(nn.Module):
    """The whole model as one module: ``layers`` applied in order. Parameter names are ``layers.{i}.…``."""

    def __init__(self, cfg: Any, vocab_size: int, seed: int = 0) -> None:
        super().__init__()
        self.layers = nn.ModuleList(build_layers(cfg, vocab_size, seed))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = ids
        for layer in self.layers:
            h = layer(h)
        return h


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every position, computed in fp32."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def count_parameters(module: nn.Module) -> int:
    """Distinct parameters (a tied weight counts once)."""
    return sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())
