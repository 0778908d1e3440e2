"""How a pipeline cuts the layer list into stages (pure Python, no torch: `plan`, the cost model and the report read
it); `asyncpipe.model.partition` re-exports it for the engines."""

from __future__ import annotations


def partition(n_layers_total: int, stages: int) -> list[int]:
    """Stage boundaries over ``[Embedding, Block x n, Head]``: stage s owns ``layers[parts[s]:parts[s+1]]``.

    Blocks are spread as evenly as possible (earlier stages take the remainder); the embedding rides with
    the first stage and the head with the last, since both are cheap next to a block.
    """
    n_blocks = n_layers_total - 2
    if stages < 1:
        raise ValueError(f"stages must be >= 1, got {stages}")
    if n_blocks < stages:
        raise ValueError(f"{stages} stages need at least {stages} transformer blocks, the model has {n_blocks}")
    base, extra = divmod(n_blocks, stages)
    parts = [0]
    for s in range(stages):
        blocks = base + (1 if s < extra else 0)
        parts.append(parts[-1] + blocks + (1 if s == 0 else 0))
    parts[-1] += 1  # the head
    return parts


def stage_layers(n_layers_total: int, stages: int, rank: int, v_shape: bool = False) -> tuple[list[int], list[int]]:
    """(chunk boundaries, layer indices of ``rank``): P chunks, one per rank in order, or with ``v_shape`` 2P
    chunks in a V (DualPipeV: rank r holds chunk r and chunk 2P-1-r, so rank 0 holds the embedding and head)."""
    if not v_shape:
        parts = partition(n_layers_total, stages)
        return parts, list(range(parts[rank], parts[rank + 1]))
    parts = partition(n_layers_total, 2 * stages)
    mirror = 2 * stages - 1 - rank
    return parts, list(range(parts[rank], parts[rank + 1])) + list(range(parts[mirror], parts[mirror + 1]))
