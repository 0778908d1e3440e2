"""The pipeline cost model: what one optimizer step of a declared schedule costs at any P, m and data-parallel width,
from per-layer forward / backward seconds, an optimizer-step cost per parameter, a p2p cost per exchange and the
engine's overhead per instruction (a `CostModel`), replayed through the schedule's own instruction stream.

How the work becomes a step time (`predict`):
- The layer list [embedding, blocks, head] is cut as the engine cuts it (`asyncpipe.partition`: P chunks, or 2P in
  a V for a two-chunk schedule; `predict`'s ``cut``, the run's `pipeline.cut`); a chunk's forward (backward) per
  micro-batch is the sum of its layers' (+ ``chunk_s``, the engine's own work around one pass), a stage's
  optimizer step is ``step_per_param`` x its parameters (+ ``ef_per_param`` x them with error feedback: EF's extra
  vector work per step), + the data-parallel gradient all-reduce when D > 1 (ring: 2 (D-1)/D x 4 bytes x params at
  ``allreduce_bytes_per_s``, + ``allreduce_latency_s``).
- Every schedule's instruction stream (1F1B as DeepSpeed's `TrainSchedule`, 2BW with its deferred step where
  global clipping needs it, PACI with its per-stage steps, paci-recompute's recomputed straddlers, DualPipeV as
  DeepSpeed's `DualPipeVSchedule` ticks, two chunks per rank with their commits: `ScheduleSpec.cost_stream`) is
  replayed by `timelines.timeline.simulate` with those costs (a V's pass at its chunk's), ``overhead_s`` per
  instruction, ``p2p_s`` per completed exchange, and, under global clipping, every stage's step waiting for the
  norm all-reduce (``allreduce_latency_s``). The step time is the steady state: the makespan ``batches + 1``
  batches add over ``batches``.
Bubble: the idle share of the least busy stage over a steady step. Memory is `asyncpipe.plan`'s.
Where the costs come from: `asyncpipe.timelines.cost_source` (a bench calibration or a device profile). Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from asyncpipe.errors import UserError


@dataclass(frozen=True)
class CostModel:
    """Per-layer costs of one model (the layer list [embedding, blocks, head]) and the per-step terms, in seconds."""

    label: str  # where the figures come from, said beside every prediction
    measured: bool  # True: measured on a machine; False: a stated (assumed) device profile
    forward: list[float]  # per layer: seconds per micro-batch
    backward: list[float]
    params: list[int]  # per layer
    tokens_per_micro_batch: int
    step_per_param: float  # optimizer step (clip, lr, update), seconds per parameter
    ef_per_param: float = 0.0  # EF's extra work per step, seconds per parameter
    p2p_s: float = 0.0  # each completed exchange (send / receive round)
    overhead_s: float = 0.0  # the engine's own time per instruction
    allreduce_latency_s: float = 0.0  # one small all-reduce (the global gradient norm; the start of a big one)
    allreduce_bytes_per_s: Optional[float] = None  # data-parallel gradient all-reduce bandwidth; None: not known
    link_bytes_per_s: Optional[float] = (
        None  # between a pipeline's stages (a tied matrix's all-reduce); None: not known
    )
    # seconds every chunk's forward and backward pass adds beyond its layers' (the engine's own work around a pass:
    # measured in the stand-in mode, where a V pays it once per chunk, twice per micro-batch and rank)
    chunk_s: tuple[float, float] = (0.0, 0.0)
    notes: tuple[str, ...] = field(default_factory=tuple)

    def with_overhead(self, overhead_s: float) -> "CostModel":
        return CostModel(**{**self.__dict__, "overhead_s": overhead_s})


@dataclass(frozen=True)
class Prediction:
    schedule: str
    stages: int
    micro_batches: int
    data_parallel: int
    ef: bool
    step_s: float  # one optimizer step in the steady state
    bubble: float  # idle share of the least busy stage over a step
    forward_s: list[float]  # the per-stage figures it was replayed with
    backward_s: list[float]
    update_s: list[float]
    timeline: Any = field(default=None, compare=False, repr=False)  # the replay of batches + 1 batches (to draw)

    def tokens_per_s(self, tokens_per_micro_batch: int) -> float:
        return tokens_per_micro_batch * self.micro_batches * self.data_parallel / self.step_s


def stage_costs(
    model: CostModel,
    stages: int,
    chunks: int = 1,
    data_parallel: int = 1,
    ef: bool = False,
    cut: Optional[Sequence[int]] = None,
) -> tuple[list[float], list[float], list[float], list[int]]:
    """Per chunk (P x chunks of them, in model order): forward and backward seconds per micro-batch; per rank:
    optimizer-step seconds (+ EF, + the data-parallel all-reduce) and parameters. ``cut``: blocks per chunk
    (`asyncpipe.partition`, `pipeline.cut`); None: the even cut."""
    from asyncpipe.partition import partition

    n_chunks = stages * chunks
    n_layers = len(model.forward)
    if n_chunks > n_layers - 2:
        raise UserError(
            f"{n_chunks} model chunks need at least {n_chunks} transformer blocks; the model has {n_layers - 2}"
        )
    parts = partition(n_layers, n_chunks, cut)
    fwd = [sum(model.forward[parts[c] : parts[c + 1]]) + model.chunk_s[0] for c in range(n_chunks)]
    bwd = [sum(model.backward[parts[c] : parts[c + 1]]) + model.chunk_s[1] for c in range(n_chunks)]
    chunk_params = [sum(model.params[parts[c] : parts[c + 1]]) for c in range(n_chunks)]
    rank_chunks = [[r] if chunks == 1 else [r, n_chunks - 1 - r] for r in range(stages)]
    params = [sum(chunk_params[c] for c in cs) for cs in rank_chunks]
    update = []
    for n in params:
        u = n * (model.step_per_param + (model.ef_per_param if ef else 0.0))
        if data_parallel > 1:
            if model.allreduce_bytes_per_s is None:
                raise UserError(
                    f"data_parallel={data_parallel}: the cost model ({model.label}) has no all-reduce "
                    "bandwidth; give a device profile with allreduce_bytes_per_s"
                )
            u += (
                model.allreduce_latency_s
                + 2 * (data_parallel - 1) / data_parallel * 4 * n / model.allreduce_bytes_per_s
            )
        update.append(u)
    return fwd, bwd, update, params


def _streams(name: str, m: int, P: int, batches: int, defer: bool) -> list[list]:
    from asyncpipe.schedules import get
    from asyncpipe.schedules.instructions import flatten

    spec = get(name)
    # torch-free: 1F1B's is DeepSpeed's TrainSchedule order written out, DualPipeV's its DualPipeVSchedule ticks
    make = spec.ideal or spec.stream or spec.cost_stream
    return [flatten(make(m, P, s, batches, 0, defer)) for s in range(P)]


def _defers(spec: Any, P: int, clip: str) -> bool:
    """Whether the engine defers the step (`asyncpipe.plan`'s rule): two versions, global clipping, P > 1."""
    return spec.stream is not None and spec.weight_versions(P, 0) > 1 and clip == "global" and P > 1


def predict(
    model: CostModel,
    schedule: str,
    stages: int,
    micro_batches: int,
    data_parallel: int = 1,
    ef: bool = False,
    clip: Optional[str] = None,
    batches: int = 4,
    cut: Optional[Sequence[int]] = None,
    tied: bool = False,
) -> Prediction:
    """The steady-state step of ``schedule`` (a declared schedule the pipeline engine runs) at P, m and D under
    ``model``; ``clip``: global (one norm all-reduce across stages per step) or stage (default: global where the
    schedule can); ``cut``: blocks per chunk (P, or 2P for a V; None: even), as `pipeline.cut` gives the engine;
    ``tied``: tied embeddings, whose two copies (first and last stage, `engines.pipeline.tied`) sum their gradients each
    step: without a global norm, those two stages' steps wait for each other. Torch-free: the report calls it."""
    from asyncpipe.schedules import get
    from asyncpipe.timelines.timeline import simulate

    spec = get(schedule)
    P, m = stages, micro_batches
    clip = clip or spec.clip_modes[0]
    collective = clip == "global"
    fwd, bwd, upd, _ = stage_costs(model, P, spec.chunks, data_parallel, ef, cut)
    if spec.stream is None and spec.ideal is None and spec.cost_stream is None:
        raise UserError(f"schedule {schedule}: no instruction stream to replay")
    if not spec.fits(P, m):
        raise UserError(f"schedule {schedule} needs micro-batches >= stages (got m={m}, P={P})")
    defer = _defers(spec, P, clip)
    groups: Any = collective
    if collective:  # the global-norm all-reduce: its latency is paid inside every stage's step
        upd = [u + model.allreduce_latency_s for u in upd]
    if tied and P > 1 and spec.chunks == 1:  # the tied matrix's own all-reduce between the two stages holding it
        groups = groups or [[0, P - 1]]  # a global norm already waits for every stage
        upd = [u + (_tied_allreduce_s(model) if s in (0, P - 1) else 0.0) for s, u in enumerate(upd)]

    def run(n: int) -> Any:
        return simulate(
            _streams(spec.name, m, P, n, defer),
            fwd,
            bwd,
            upd,
            latency=model.p2p_s,
            collective_steps=groups,
            overhead=model.overhead_s,
            recompute=spec.recompute,
        )

    a, b = run(batches), run(batches + 1)
    step = b.makespan - a.makespan
    busy = [y - x for x, y in zip(a.busy, b.busy)]
    if spec.chunks > 1:  # per rank: its chunks together (rank r holds chunk r and its mirror 2P-1-r)
        fwd, bwd = ([c[r] + c[2 * P - 1 - r] for r in range(P)] for c in (fwd, bwd))
    bubble = max(0.0, 1 - min(busy) / step)
    return Prediction(spec.name, P, m, data_parallel, ef, step, bubble, fwd, bwd, upd, timeline=b)


def _tied_allreduce_s(model: CostModel) -> float:
    """The tied matrix's gradient all-reduce over its two stages (one pipeline's, on its stage-to-stage link): its
    latency, + its 4-byte gradient once over the link where the model knows the link's bandwidth (a two-rank ring
    sends each half once each way)."""
    nbytes = 4 * model.params[0]  # the embedding's matrix: the copy the last stage holds is the same size
    bandwidth = model.link_bytes_per_s
    return model.allreduce_latency_s + (nbytes / bandwidth if bandwidth else 0.0)


def ratio(model: CostModel, schedule: str, reference: str, stages: int, micro_batches: int, ef: bool = False) -> float:
    """Throughput of ``schedule`` over ``reference`` (the same tokens per step) under ``model``."""
    mine = predict(model, schedule, stages, micro_batches, ef=ef)
    ref = predict(model, reference, stages, micro_batches)
    return ref.step_s / mine.step_s
