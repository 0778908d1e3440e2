"""The parameter and FLOP facts of the GPT's layer list ``[embedding, block x n_layer, head]`` from a model config
alone (torch-free): read by the memory plan (`asyncpipe.plan`), the stage cut (`asyncpipe.partition`) and the cost
model (`asyncpipe.timelines.cost_source`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class LayerShape:
    """Parameter and activation facts of one layer of the GPT's layer list."""

    kind: str  # embedding, block, head
    params: int
    active: int  # parameters one token uses (experts: only its top-k)
    hidden: int  # parameters Muon orthogonalises (block matrices, expert stacks)
    # (count, shape, Muon's) of every weight tensor of 2+ dims; Muon's: a block matrix or expert stack
    tensors: list[tuple[int, tuple[int, ...], bool]] = field(default_factory=list)
    router: int = 0  # MoE router parameters (AdamW unless optimizer.muon_router)


def layer_shapes(m: Any, vocab: int) -> list[LayerShape]:
    """``[embedding, block x n_layer, head]`` of a `ModelConfig`-shaped ``m``, as `model.build_layers` makes them."""
    d, hd = m.d_model, m.d_model // m.n_head
    kvd = (m.n_kv_head or m.n_head) * hd
    attn = [(2, (d, d), True), (2, (kvd, d), True)]  # q, o; k, v
    attn_params = 2 * d * d + 2 * kvd * d + 2 * d  # + the two norms
    moe = getattr(m, "moe", None)
    if moe is not None and moe.experts:
        e, k, de = moe.experts, moe.top_k, moe.d_expert or m.d_ff
        expert = 3 * d * de
        shared = expert if moe.shared_expert else 0
        router = e * d
        params = attn_params + router + e * expert + shared
        active = attn_params + router + k * expert + shared
        hidden = params - 2 * d - router
        mats = attn + [(3, (e, de, d), True), (1, (e, d), False)]  # w_gate, w_up, w_down (same sizes); router
        mats += [(3, (de, d), True)] if shared else []
    else:
        params = active = attn_params + 3 * d * m.d_ff
        hidden = params - 2 * d
        mats = attn + [(3, (m.d_ff, d), True)]  # gate, up, down
        router = 0
    emb = vocab * d
    head = d + (0 if m.tie_embeddings else vocab * d)
    return (
        [LayerShape("embedding", emb, emb, 0, tensors=[(1, (vocab, d), False)])]
        + [LayerShape("block", params, active, hidden, tensors=mats, router=router) for _ in range(m.n_layer)]
        + [LayerShape("head", head, head, 0, tensors=[] if m.tie_embeddings else [(1, (vocab, d), False)])]
    )


def layer_flops(m: Any, vocab: int, seq_len: int) -> list[float]:
    """Forward FLOPs per token of each layer of ``layer_shapes(m, vocab)``: a block's matmuls (2 x its active
    parameters but the norms) + causal attention's 2 x seq x d_model, the head's 2 x d_model x vocab (its matmul,
    tied or not), the embedding a lookup (0). Backward is a fixed multiple, so these also rank forward + backward."""

    def flops(x: LayerShape) -> float:
        if x.kind == "embedding":
            return 0.0
        if x.kind == "head":
            return 2.0 * m.d_model * vocab
        return 2.0 * (x.active - 2 * m.d_model) + 2.0 * seq_len * m.d_model

    return [flops(x) for x in layer_shapes(m, vocab)]
