"""How a pipeline cuts the layer list ``[embedding, block x n, head]`` into stages (pure Python, no torch: `plan`,
the cost model and the report read it; `asyncpipe.model.partition` re-exports it for the engines).

A cut is given as blocks per chunk (one chunk per stage, or 2P in a V for a two-chunk schedule): the embedding
rides with chunk 0 and the head with the last chunk, every chunk holds at least one block. `pipeline.cut` picks it:
- ``even``: blocks spread as evenly as possible, earlier chunks taking the remainder;
- ``balanced`` (the default): the cut that minimises the slowest chunk's forward + backward per micro-batch, by
  each layer's FLOPs (`asyncpipe.shapes.layer_flops`: the head at its real vocabulary, the embedding a free
  lookup), or under per-layer stand-in compute by each layer's stand-in seconds (`asyncpipe.standin_costs`: there
  the waits are the compute; `layer_weights`). The pipeline's step is paced by its slowest stage (2BW and PACI have no flush to hide it in), so this is
  the cut that minimises the predicted step; a device profile scales every layer's FLOPs alike (backward a fixed
  multiple of forward), so the cut does not depend on which profile prices it. Deterministic: where the even cut
  is as fast it is kept (small heads, byte tokens), else, among the fastest cuts, the one whose chunk costs have
  the least sum of squares, ties to the earliest boundaries. Within a memory budget (`pipeline.memory_gib`, or
  `asyncpipe plan --gpu-mem`) the same search runs over only the cuts whose every chunk a caller's ``fits``
  predicate accepts (`asyncpipe.plan.cut_within` passes the plan's memory model; this module knows no bytes);
- a list of blocks per chunk (P entries, 2P for DualPipeV's V), summing to the model's blocks.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

CUTS = ("even", "balanced")
_TIE = 1e-9  # relative: two bottlenecks this close are equal (float sums in another order)
# fits(chunk, first_layer, end_layer): whether chunk ``chunk`` may hold layers [first_layer, end_layer)
Fits = Callable[[int, int, int], bool]
# cost(chunk, first_layer, end_layer): a chunk's figure (seconds, bytes) were it to hold those layers
ChunkCost = Callable[[int, int, int], float]


class NoCutFits(ValueError):
    """No cut of the layer list has every chunk accepted by the ``fits`` predicate."""


def even_blocks(n_blocks: int, chunks: int) -> list[int]:
    """Blocks per chunk, spread as evenly as possible; earlier chunks take the remainder."""
    if chunks < 1:
        raise ValueError(f"stages must be >= 1, got {chunks}")
    if n_blocks < chunks:
        raise ValueError(f"{chunks} stages need at least {chunks} transformer blocks, the model has {n_blocks}")
    base, extra = divmod(n_blocks, chunks)
    return [base + (1 if c < extra else 0) for c in range(chunks)]


def partition(n_layers_total: int, stages: int, blocks: Optional[Sequence[int]] = None) -> list[int]:
    """Chunk boundaries over ``[Embedding, Block x n, Head]``: chunk s owns ``layers[parts[s]:parts[s+1]]``.

    ``blocks``: blocks per chunk (None: `even_blocks`); the embedding rides with the first chunk, the head with
    the last."""
    n_blocks = n_layers_total - 2
    blocks = even_blocks(n_blocks, stages) if blocks is None else list(blocks)
    problem = check_blocks(blocks, n_blocks, stages)
    if problem:
        raise ValueError(problem)
    parts = [0]
    for s, b in enumerate(blocks):
        parts.append(parts[-1] + b + (1 if s == 0 else 0))
    parts[-1] += 1  # the head
    return parts


def check_blocks(blocks: Sequence[Any], n_blocks: int, chunks: int) -> str:
    """Why ``blocks`` is not a cut of ``n_blocks`` blocks into ``chunks`` chunks ('' when it is)."""
    if len(blocks) != chunks or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in blocks):
        return f"pipeline.cut={list(blocks)} must list {chunks} whole numbers >= 1: blocks per stage (per chunk in a V)"
    if sum(blocks) != n_blocks:
        return f"pipeline.cut={list(blocks)} holds {sum(blocks)} blocks; the model has {n_blocks}"
    return ""


def chunk_costs(costs: Sequence[float], blocks: Sequence[int]) -> list[float]:
    """Each chunk's cost: the sum of its layers' ``costs`` (per layer of the whole list) under the cut ``blocks``."""
    parts = partition(len(costs), len(blocks), blocks)
    return [sum(costs[parts[c] : parts[c + 1]]) for c in range(len(blocks))]


def balanced_blocks(costs: Sequence[float], chunks: int, fits: Optional[Fits] = None) -> list[int]:
    """The cut (blocks per chunk) of the layer list with per-layer ``costs`` that minimises the costliest chunk
    (see the module docstring for the tie rules); ``fits``: only cuts whose every chunk it accepts (None: all),
    `NoCutFits` when none is."""
    n_blocks = len(costs) - 2
    even = even_blocks(n_blocks, chunks)
    best = _min_bottleneck(costs, chunks, fits)
    if best == float("inf"):
        raise NoCutFits(f"no cut of {n_blocks} blocks into {chunks} chunks has every chunk fit")
    if max(chunk_costs(costs, even)) <= best * (1 + _TIE) and _all_fit(even, fits):
        return even
    return _least_squares_under(costs, chunks, best * (1 + _TIE), fits)


def _all_fit(blocks: Sequence[int], fits: Optional[Fits]) -> bool:
    parts = partition(sum(blocks) + 2, len(blocks), blocks)
    return fits is None or all(fits(c, parts[c], parts[c + 1]) for c in range(len(blocks)))


def least_peak(n_layers_total: int, chunks: int, cost: ChunkCost) -> tuple[float, list[int]]:
    """(the smallest possible costliest chunk, a cut that reaches it) where a chunk's figure is ``cost(chunk,
    first_layer, end_layer)``, any figure that is not a sum of per-layer ones (a stage's memory: it depends on
    which stage holds the layers)."""
    n, inf = n_layers_total, float("inf")
    best = [[inf] * (n + 1) for _ in range(chunks + 1)]
    back = [[-1] * (n + 1) for _ in range(chunks + 1)]
    best[0][0] = 0.0
    for c in range(1, chunks + 1):
        for j in _ends(c, chunks, n):
            for i in _starts(c, chunks, j):
                if best[c - 1][i] < inf:
                    peak = max(best[c - 1][i], cost(c - 1, i, j))
                    if peak < best[c][j]:
                        best[c][j], back[c][j] = peak, i
    return best[chunks][n], _blocks_of(back, chunks, n)


def _prefix(costs: Sequence[float]) -> list[float]:
    out = [0.0]
    for c in costs:
        out.append(out[-1] + c)
    return out


def _min_bottleneck(costs: Sequence[float], chunks: int, fits: Optional[Fits] = None) -> float:
    """The smallest possible costliest chunk among the cuts ``fits`` accepts (inf: none) (dynamic programme over
    the boundaries, O(chunks x n^2))."""
    pre, n = _prefix(costs), len(costs)
    inf = float("inf")
    # best[c][j]: the least costliest chunk when chunks 0..c-1 hold layers [0, j); chunk 0 starts with the embedding
    best = [[inf] * (n + 1) for _ in range(chunks + 1)]
    best[0][0] = 0.0
    for c in range(1, chunks + 1):
        for j in _ends(c, chunks, n):
            for i in _starts(c, chunks, j):
                if best[c - 1][i] < inf and (fits is None or fits(c - 1, i, j)):
                    best[c][j] = min(best[c][j], max(best[c - 1][i], pre[j] - pre[i]))
    return best[chunks][n]


def _ends(c: int, chunks: int, n: int) -> range:
    """Where chunk c-1 (of ``chunks``, each >= 1 block, the embedding first, the head last) may end."""
    if c == chunks:
        return range(n, n + 1)
    return range(1 + c, n - 1 - (chunks - c) + 1)


def _starts(c: int, chunks: int, j: int) -> range:
    """Where chunk c-1 may start if it ends at j: one block at least (the last chunk's also the head); the first
    chunk starts at the embedding, chunk c-1 after the embedding and c-1 blocks."""
    if c == 1:
        return range(0, 1) if j >= 2 else range(0)
    return range(c, j - (2 if c == chunks else 1) + 1)


def _least_squares_under(costs: Sequence[float], chunks: int, cap: float, fits: Optional[Fits] = None) -> list[int]:
    """Among the cuts whose every chunk costs at most ``cap`` (and ``fits``), the one with the least sum of
    squared chunk costs (earliest boundaries on ties)."""
    pre, n = _prefix(costs), len(costs)
    inf = float("inf")
    score = [[inf] * (n + 1) for _ in range(chunks + 1)]
    back = [[-1] * (n + 1) for _ in range(chunks + 1)]
    score[0][0] = 0.0
    for c in range(1, chunks + 1):
        for j in _ends(c, chunks, n):
            for i in _starts(c, chunks, j):
                cost = pre[j] - pre[i]
                if score[c - 1][i] == inf or cost > cap or (fits is not None and not fits(c - 1, i, j)):
                    continue
                s = score[c - 1][i] + cost * cost
                if s < score[c][j] * (1 - _TIE):
                    score[c][j], back[c][j] = s, i
    return _blocks_of(back, chunks, n)


def _blocks_of(back: list[list[int]], chunks: int, n: int) -> list[int]:
    """Blocks per chunk from a programme's back pointers (``back[c][j]``: where chunk c-1 starts if it ends at j)."""
    bounds, j = [n], n
    for c in range(chunks, 0, -1):
        j = back[c][j]
        bounds.append(j)
    bounds.reverse()
    layers = [bounds[c + 1] - bounds[c] for c in range(chunks)]
    layers[0] -= 1
    layers[-1] -= 1
    return layers


def stage_layers(
    n_layers_total: int, stages: int, rank: int, v_shape: bool = False, blocks: Optional[Sequence[int]] = None
) -> tuple[list[int], list[int]]:
    """(chunk boundaries, layer indices of ``rank``): P chunks, one per rank in order, or with ``v_shape`` 2P
    chunks in a V (DualPipeV: rank r holds chunk r and chunk 2P-1-r, so rank 0 holds the embedding and head);
    ``blocks``: blocks per chunk (`cut_blocks`; None: even)."""
    if not v_shape:
        parts = partition(n_layers_total, stages, blocks)
        return parts, list(range(parts[rank], parts[rank + 1]))
    parts = partition(n_layers_total, 2 * stages, blocks)
    mirror = 2 * stages - 1 - rank
    return parts, list(range(parts[rank], parts[rank + 1])) + list(range(parts[mirror], parts[mirror + 1]))


def layer_weights(cfg: Any) -> list[float]:
    """What the balanced cut weighs each layer of ``cfg``'s model by: its stand-in forward + backward seconds
    under per-layer stand-in compute (`asyncpipe.standin_costs`: there the waits are the compute), else its FLOPs
    (`asyncpipe.shapes.layer_flops`, the head at its real vocabulary)."""
    from asyncpipe.shapes import layer_flops
    from asyncpipe.standin_costs import layer_costs

    standin = layer_costs(cfg)
    if standin is not None:
        return [f + b for f, b in zip(*standin)]
    m = cfg.model
    return layer_flops(m, int(m.vocab_size or cfg.tokenizer.vocab_size), int(cfg.train.seq_len))


def cut_blocks(cfg: Any, chunks: Optional[int] = None, fits: Optional[Fits] = None) -> list[int]:
    """Blocks per chunk of the run ``cfg`` (a composed config) under its `pipeline.cut`; ``chunks``: P x the
    schedule's chunks per rank (None: read from the schedule `pipeline.schedule` resolves to); ``fits``: the
    balanced cut only among cuts whose every chunk it accepts (`asyncpipe.plan.cut_within` passes a memory
    budget's). A balanced cut under `pipeline.memory_gib` needs that predicate: without it, one line."""
    from asyncpipe.errors import ConfigError

    if chunks is None:
        from asyncpipe.schedules import resolve

        chunks = cfg.pipeline.stages * resolve(cfg).chunks
    m = cfg.model
    cut = cfg.pipeline.get("cut", "balanced")
    if cut == "even":
        return even_blocks(m.n_layer, chunks)
    if cut == "balanced":
        budget = cfg.pipeline.get("memory_gib")
        if budget is not None and fits is None:
            raise ConfigError(
                f"pipeline.memory_gib={budget:g} balances the cut within the budget for asyncpipe train, sweep, "
                "bench pipeline and plan; here give the cut as a list (pipeline.cut=[...], as `asyncpipe plan` prints it)"
            )
        return balanced_blocks(layer_weights(cfg), chunks, fits)
    blocks = list(cut)
    problem = check_blocks(blocks, m.n_layer, chunks)
    if problem:
        raise ConfigError(problem)
    return blocks


def cut_problem(cfg: Any) -> str:
    """Why ``cfg``'s `pipeline.cut` cannot cut its model ('' when it can): the config check, one line."""
    cut = cfg.pipeline.get("cut", "balanced")
    if isinstance(cut, str):
        allowed = f"choose one of: {', '.join(CUTS)}, or a list of blocks per stage"
        return "" if cut in CUTS else f"pipeline.cut={cut} is not allowed; {allowed}"
    from asyncpipe.schedules import resolve

    return check_blocks(list(cut), cfg.model.n_layer, cfg.pipeline.stages * resolve(cfg).chunks)


def ends_read_one_version(spec: Any, stages: int, micro_batches: int, batches: int = 4) -> bool:
    """Whether two tied copies, one on the first stage and one on the last, each reading its own stage's declared
    `versions`, read the simulator's one matrix (checked over a few batches): either both stages read one version
    for every micro-batch, forward and backward (1F1B, 2BW: the simulator's per-parameter delay), or the simulator
    runs the stages apart in place (``stage_delay`` None, the in-place straddle recipe: PACI) and the last stage
    reads batch b's own version W(b) for each of its micro-batches, forward and backward, the version the
    simulator's head reads (`engines.staged` moves only stage 0's parameters, the matrix included, to an older
    version, and only for stage 0's forward; the lookup's backward reads no weight). See `engines.pipeline.tied`."""
    m, ks = micro_batches, range(batches * micro_batches)
    if spec.stage_delay is None and spec.straddle == "inplace":
        return all(spec.versions(stages, m, stages - 1, k) == (k // m, k // m) for k in ks)
    for k in ks:
        first = spec.versions(stages, m, 0, k)
        last = spec.versions(stages, m, stages - 1, k)
        if first != last or first[0] != first[1]:
            return False
    return True


def tied_problem(cfg: Any) -> str:
    """Why ``cfg``'s tied embeddings cannot run on `engine=pipeline` ('' when they can): split over the first and
    the last stage, the two copies are summed and stepped alike (`engines.pipeline.tied`) under 1F1B, 2BW (+ EF) and
    PACI (in place), where each copy reads the simulator's version of the matrix (`ends_read_one_version`), and under
    PyTorch's schedules that do not split their backward (`torch_schedules.config_problem` refuses those). Clipping
    per stage only where the simulator clips per stage (a schedule it runs stage by stage: PACI)."""
    from asyncpipe.schedules import resolve

    p, spec = cfg.pipeline, resolve(cfg)
    untie = f"add model.tie_embeddings=false (model '{cfg.model.name}' ties them)"
    if p.stages == 1 or (spec.chunks > 1 and p.get("torch_schedule") is None):
        return ""  # the embedding and the head in one process (a V): tied there
    name = spec.name
    if not ends_read_one_version(spec, p.stages, cfg.train.micro_batches):
        return (
            f"engine=pipeline ties embeddings across stages under 1f1b, 2bw and paci only (pipeline.schedule={name}: "
            f"its first and last stage do not read the simulator's version of the one tied matrix); {untie}"
        )
    if p.clip == "stage" and cfg.train.grad_clip > 0 and spec.stage_delay is not None:
        return (
            f"tied embeddings across stages need pipeline.clip=global under pipeline.schedule={name} (the "
            f"simulator clips it by one norm; per stage under paci only); {untie}"
        )
    return ""
