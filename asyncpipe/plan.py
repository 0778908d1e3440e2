"""Memory plan of a pipeline run before launching it: per stage, the bytes of weights (the versions the schedule
declares, `asyncpipe.schedules`: 1 for 1F1B, DualPipeV and PACI, 2 for 2BW), gradients, optimizer state, error-feedback buffers and the activations of the micro-batches in flight,
from the config's shapes alone (no tensor is allocated), against a GPU memory budget.

The model (bytes per parameter, elements saved per token) follows what this code base stores:
- weights are fp32 masters (bf16 is autocast), one copy per live version; gradients are fp32, one buffer, two
  under 2BW when the step is deferred (the next batch accumulates while the last one's step waits), plus a
  transient flat copy for the data-parallel all-reduce when D > 1;
- optimizer state: the memory model the optimizer's module declares (`asyncpipe.registry`): AdamW/NAdam 2 fp32
  buffers per parameter; Muon 1 (momentum) on the hidden matrices and expert stacks, AdamW's 2 on the rest; SOAP
  2 plus G G^T and its eigenbasis (n x n) per dimension n <= 10000 of every 2+-D tensor (`tests/test_plan.py`
  compares each with the bytes the optimizer allocates); an optimizer the registry does not know is an error;
- the compensation method (EF included: the *_ef presets are the method ``ef``): the parameter-sized
  buffers its module declares (the step's snapshot included) plus its own memory model, in one column;
- activations: the tensors autograd saves per token, counted layer by layer (`_saved_per_token`), for each
  micro-batch in flight on stage s, as the schedule declares it per model chunk (min(P - s, m) under 1F1B, 2BW
  and PACI; DualPipeV's two chunks per rank counted on DeepSpeed's order, each chunk at its own peak); a chunk's
  output activation is held too until its gradient returns, and the loss chunk keeps its logits;
- bf16 autocast copies (precision bf16): every micro-batch's forward casts each matmul weight to bf16 and autograd
  keeps that copy until the micro-batch's backward (autocast's cast cache lives for one forward), so a stage holds
  2 bytes x its matmul parameters (every 2+-D tensor but the embedding table, which is looked up, not multiplied;
  all experts, as every expert receives tokens at real batch sizes) per micro-batch in flight (`_cast_params`,
  measured in `tests/test_plan.py`). This does not depend on the micro-batch size.
It ignores allocator slack, framework workspaces and communication buffers other than those named.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

from asyncpipe.shapes import LayerShape, layer_shapes  # their home; `plan.layer_shapes` stays importable

GIB = 2**30


def _vocab(cfg: Any) -> int:
    return int(cfg.model.vocab_size or cfg.tokenizer.vocab_size)


def model_params(m: Any, vocab: int) -> tuple[int, int]:
    """(total, active per token) parameters of the model (a tied embedding counted once)."""
    shapes = layer_shapes(m, vocab)
    return sum(s.params for s in shapes), sum(s.active for s in shapes)


def _saved_per_token(m: Any, kind: str, vocab: int, bf16: bool) -> float:
    """Bytes autograd keeps per token for one layer's backward (measured layer by layer with saved-tensor hooks
    on CPU fp32; under bf16 autocast the matmul inputs and outputs are bf16, norms and residuals fp32)."""
    d, h = m.d_model, m.n_head
    kvd = (m.n_kv_head or m.n_head) * (d // h)
    lo = 2 if bf16 else 4  # bytes of a tensor saved around a matmul
    if kind == "embedding":
        return 8.0  # the token ids
    if kind == "head":
        # norm input, normalised, output (+ bf16 copy); log-softmax output (fp32); logits held by the loss stage
        return 3 * d * 4 + (d * 2 if bf16 else 0) + vocab * 4 + vocab * lo + 8
    norm = 3 * d * 4 + 4 + (d * 2 if bf16 else 0)  # input, normalised, output, rstd (+ bf16 copy for matmuls)
    attn = (2 * d + 2 * kvd) * lo + h * 4  # q, k, v after RoPE, the output (o's input); logsumexp
    moe = getattr(m, "moe", None)
    if moe is not None and moe.experts:
        e, k, de = moe.experts, moe.top_k, moe.d_expert or m.d_ff
        # logits, probs, two logsumexp/sum scalars; per assignment: top-k value, index, sort order, token, weight
        router = 2 * e * 4 + (e * lo if bf16 else 0) + 8 + k * (4 + 8 + 8 + 8 + 4)
        # gathered inputs, SwiGLU internals, outputs; the fp32 copy the top-k combine weights (fp32 accumulation)
        experts = k * ((2 * d + 4 * de) * lo + d * 4)
        shared = 4 * de * lo if moe.shared_expert else 0
        mlp = router + experts + shared
    else:
        mlp = 4 * m.d_ff * lo  # gate and up outputs, silu, down's input
    return 2 * norm + attn + mlp


def _cast_params(shape: LayerShape, vocab: int, d_model: int) -> int:
    """Parameters of ``shape`` that bf16 autocast copies in every training forward: its matmul weights (a head
    tied to the embedding is cast too; the embedding lookup is not)."""
    if shape.kind == "embedding":
        return 0
    if shape.kind == "head":
        return vocab * d_model
    return sum(count * math.prod(dims) for count, dims, _ in shape.tensors)


@dataclass
class StagePlan:
    stage: int
    layers: tuple[int, int]  # [first, last) index into the layer list (the first chunk's, for a V)
    params: int
    versions: int
    weights: float  # bytes
    grads: float
    optimizer: float
    ef: float  # optimizer.ef and the `compensation` method's buffers
    in_flight: int
    act_per_micro_batch: float  # bytes at the configured micro-batch size
    activations: float
    total: float
    max_micro_batch: int  # largest micro-batch size whose total fits the budget (0: none)
    chunks: list[tuple[int, int]] = field(default_factory=list)  # every chunk's range (two in DualPipeV's V)
    casts: float = 0.0  # bf16 autocast copies of the matmul weights, one per micro-batch in flight (bytes)


@dataclass
class Plan:
    model: str
    total_params: int
    active_params: int
    stages: list[StagePlan]
    schedule: str  # the declared schedule's name, upper case (1F1B, 2BW, DUALPIPEV, PACI, ...)
    gpu_mem_gib: float
    notes: list[str]
    n_layer: int = 0  # transformer blocks (the layer list is [embedding, blocks, head])

    runs: bool = True  # False: the schedule cannot run this batch on the pipeline engine (2BW with m < P)
    cut: list[int] = field(default_factory=list)  # blocks per chunk it cuts at (balanced: within the budget)
    cut_note: str = ""  # how the budget moved the balanced cut, or why it could not ('' when it did not)

    @property
    def fits(self) -> bool:
        return all(s.total <= self.gpu_mem_gib * GIB for s in self.stages)

    @property
    def ok(self) -> bool:
        """Every stage fits its budget and the schedule can run the batch (`asyncpipe plan` exits 1 otherwise)."""
        return self.fits and self.runs


def _optimizer_bytes(cfg: Any, shapes: list[LayerShape]) -> float:
    """The run's optimizer state, by the memory model its module declares (`asyncpipe.registry`)."""
    from asyncpipe.registry import optimizer_spec, target_of

    return float(optimizer_spec(cfg.optimizer.name, target_of(cfg.optimizer)).memory(cfg, shapes))


def _compensation_bytes(cfg: Any, shapes: list[LayerShape]) -> float:
    """The compensation method's buffers (EF included: the method ``ef``), by its declaration:
    ``buffers`` parameter-sized fp32 buffers plus what its ``memory`` model adds. A method that declares no
    memory model is an error, never 0 bytes."""
    from asyncpipe.errors import UserError
    from asyncpipe.registry import method_spec, target_of

    comp = cfg.compensation
    spec = method_spec(comp.name, target_of(comp))
    if spec.buffers is None:
        raise UserError(
            f"compensation={spec.name} declares no memory model (buffers=, memory=) in {spec.module}; "
            "the plan cannot count it"
        )
    params = sum(s.params for s in shapes)
    extra = float(spec.memory(cfg, shapes)) if spec.memory is not None else 0.0
    return 4.0 * spec.buffers * params + extra


def _tied_copy(shapes: list[LayerShape], m: Any, vocab: int, apart: bool) -> list[LayerShape]:
    """``shapes`` with the head holding its own copy of a tied embedding matrix when the head and the embedding sit
    on different ranks (the pipeline engine keeps one copy on each and sums their gradients): its weights,
    gradients and optimizer state count on both stages."""
    if not (m.tie_embeddings and apart):
        return shapes
    head = shapes[-1]
    matrix = vocab * m.d_model
    copy = LayerShape("head", head.params + matrix, head.active + matrix, 0, tensors=[(1, (vocab, m.d_model), False)])
    return [*shapes[:-1], copy]


def plan(cfg: Any, gpu_mem_gib: float = 80.0) -> Plan:
    """The memory plan of ``cfg`` (a composed config) as `engine=pipeline` would run it on P x D devices, against
    ``gpu_mem_gib`` per device (the run's `pipeline.memory_gib` where it sets one, within which a balanced cut is
    chosen: `cut_within`)."""
    from asyncpipe.errors import UserError
    from asyncpipe.partition import partition

    m, p = cfg.model, cfg.pipeline
    if gpu_mem_gib <= 0:
        raise UserError(f"--gpu-mem={gpu_mem_gib} must be > 0 (GiB per device)")
    key = p.get("memory_gib")
    if key is not None and float(key) != float(gpu_mem_gib):
        raise UserError(
            f"pipeline.memory_gib={key:g} and --gpu-mem {gpu_mem_gib:g} are two budgets for one plan: give one "
            "(--gpu-mem sets pipeline.memory_gib; without it the plan takes pipeline.memory_gib)"
        )
    if p.stages > m.n_layer:
        raise UserError(f"pipeline.stages={p.stages} exceeds the {m.n_layer} transformer blocks of model '{m.name}'")
    mem = Memory(cfg)
    spec, P, n_chunks = mem.spec, p.stages, mem.spec.chunks * p.stages
    if n_chunks > m.n_layer:
        raise UserError(
            f"pipeline.schedule={spec.name} cuts the model into {n_chunks} chunks of at least one block; "
            f"model '{m.name}' has {m.n_layer} blocks"
        )
    cut, cut_note = cut_within(cfg, mem)
    parts = partition(mem.n_layers, n_chunks, cut)
    stages = [mem.stage(s, mem.ranges(parts, s), gpu_mem_gib * GIB) for s in range(P)]
    total, active = model_params(m, _vocab(cfg))
    runs = not (min(int(cfg.delay), 1) == 1 and P > 1 and cfg.train.micro_batches < P)
    notes = _notes(cfg, spec, stages[-1].versions, runs, mem.deferred) + ([cut_note] if cut_note else [])
    return Plan(m.name, total, active, stages, spec.name.upper(), gpu_mem_gib, notes, m.n_layer, runs, cut, cut_note)


class Memory:
    """The memory model of one config: what every stage shares (the schedule, the layer shapes with a tied copy
    where the head and the embedding sit apart, whether 2BW defers its step, each layer's saved bytes per token and
    bf16 copies), and a stage's bytes for whatever layers it holds (`stage`), so a cut can be searched within a
    budget (`cut_within`)."""

    def __init__(self, cfg: Any) -> None:
        from asyncpipe.schedules import resolve

        m, t, p = cfg.model, cfg.train, cfg.pipeline
        self.cfg, self.spec = cfg, resolve(cfg)
        self.P, self.m, self.seq_len, self.dp = int(p.stages), int(t.micro_batches), int(t.seq_len), p.data_parallel
        self.tokens, self.delay = int(t.micro_batch_size) * self.seq_len, int(cfg.delay)
        P, spec, vocab = self.P, self.spec, _vocab(cfg)
        self.bf16 = cfg.precision == "bf16" or (cfg.precision == "auto" and cfg.device != "cpu")  # plans are for GPUs
        shapes = layer_shapes(m, vocab)
        self.n_layers = len(shapes)
        self.shapes = _tied_copy(shapes, m, vocab, spec.chunks == 1 and P > 1)
        self.saved = [_saved_per_token(m, x.kind, vocab, self.bf16) for x in self.shapes]  # bytes per token
        self.cast = [_cast_params(x, vocab, m.d_model) for x in self.shapes]
        self.out_act = m.d_model * (2 if self.bf16 else 4)  # a chunk's output, held until its gradient returns
        # As the engine: a step can be deferred where the stream runs on while a second version holds the old weights.
        self.deferred = (
            spec.stream is not None
            and spec.weight_versions(P, 0) > 1
            and p.clip == "global"
            and t.grad_clip > 0
            and P > 1
            and p.defer_step is not False
        )

    def ranges(self, parts: list[int], s: int) -> list[tuple[int, int, int]]:
        """(chunk, first layer, end layer) of each chunk stage ``s`` holds (a V: chunk s and its mirror 2P-1-s)."""
        n_chunks = len(parts) - 1
        chunks = [s] if self.spec.chunks == 1 else [s, n_chunks - 1 - s]
        return [(c, parts[c], parts[c + 1]) for c in chunks]

    def chunk_bytes(self, chunk: int, first: int, end: int) -> float:
        """Stage ``chunk``'s total were it to hold layers [first, end) (one chunk per stage)."""
        return self.stage(chunk, [(chunk, first, end)], 0.0).total

    def stage(self, s: int, ranges: list[tuple[int, int, int]], budget: float) -> StagePlan:
        """Stage ``s``'s bytes: its chunks' (``ranges``: chunk, first layer, end layer) weights (as many versions as
        the schedule keeps), gradients, optimizer and compensation state, bf16 casts and the activations of its
        micro-batches in flight, against ``budget``."""
        spec, P, n_chunks = self.spec, self.P, self.spec.chunks * self.P
        held = spec.in_flight(P, self.m, s)
        own = [x for _, a, b in ranges for x in self.shapes[a:b]]
        n = sum(x.params for x in own)
        w = 4.0 * n
        versions = spec.weight_versions(P, s)
        if spec.stage_delay is not None and spec.delay is None:  # the simulator's k-step generalisation
            versions = max(versions, 1 + spec.stage_delay(P, s, self.delay))
        grads = w * ((2 if self.deferred else 1) + (1 if self.dp > 1 else 0))
        opt = _optimizer_bytes(self.cfg, own)
        ef = _compensation_bytes(self.cfg, own)
        per_chunk = [sum(self.saved[a:b]) + (self.out_act if c < n_chunks - 1 else 0) for c, a, b in ranges]
        held_per_token = sum(k * x for k, x in zip(held, per_chunk))  # each chunk at its own peak: an upper bound
        casts = 2.0 * sum(k * sum(self.cast[a:b]) for k, (_, a, b) in zip(held, ranges)) if self.bf16 else 0.0
        static = versions * w + grads + opt + ef + casts
        fit = int((budget - static) // (held_per_token * self.seq_len)) if budget > static else 0
        chunks = [(a, b) for _, a, b in ranges]
        act = held_per_token * self.tokens
        return StagePlan(
            s,
            chunks[0],
            n,
            versions,
            versions * w,
            grads,
            opt,
            ef,
            max(held),
            sum(per_chunk) * self.tokens,
            act,
            static + act,
            max(0, fit),
            chunks,
            casts,
        )


def cut_within(cfg: Any, mem: Optional[Memory] = None, strict: bool = False) -> tuple[list[int], str]:
    """(blocks per chunk, a note): `pipeline.cut` as given, or under `pipeline.memory_gib` the balanced cut among
    those whose every stage fits the budget by this memory model (`partition.balanced_blocks` with a ``fits``
    predicate; the unconstrained balanced cut itself whenever it fits). The note says how the budget moved the
    cut, or why it could not (no cut fits; a V): then the unconstrained cut, or with ``strict`` (a run) one
    `ConfigError`."""
    from asyncpipe.errors import ConfigError
    from asyncpipe.partition import NoCutFits, balanced_blocks, cut_blocks, layer_weights, least_peak, partition

    mem, p = mem or Memory(cfg), cfg.pipeline
    n_chunks, budget = mem.spec.chunks * p.stages, p.get("memory_gib")
    if budget is None or p.get("cut", "balanced") != "balanced":
        return cut_blocks(cfg, n_chunks), ""
    weights, gib, key = layer_weights(cfg), float(budget) * GIB, f"pipeline.memory_gib={budget:g}"
    free = balanced_blocks(weights, n_chunks)
    parts = partition(mem.n_layers, n_chunks, free)
    if mem.spec.chunks > 1:  # a rank's two chunks lie apart: a stage is not one run of layers to search over
        totals = [mem.stage(s, mem.ranges(parts, s), 0.0).total for s in range(p.stages)]
        if max(totals) <= gib:
            return free, ""
        top = max(range(p.stages), key=lambda s: totals[s])
        why = (
            f"{key}: the V cut ({mem.spec.name}: rank r holds chunks r and {n_chunks - 1}-r) needs "
            f"{_gib(totals[top])} GiB on rank {top} and is not re-cut within a budget; give pipeline.cut as a list"
        )
        if strict:
            raise ConfigError(why)
        return free, f"cut {_csv(free)} (balanced without the budget: {why}; a run with it stops)"
    totals = [mem.chunk_bytes(c, parts[c], parts[c + 1]) for c in range(n_chunks)]
    if max(totals) <= gib:
        return free, ""
    known: dict[tuple[int, int, int], float] = {}

    def chunk_bytes(c: int, i: int, j: int) -> float:
        if (c, i, j) not in known:
            known[c, i, j] = mem.chunk_bytes(c, i, j)
        return known[c, i, j]

    try:
        cut = balanced_blocks(weights, n_chunks, fits=lambda c, i, j: chunk_bytes(c, i, j) <= gib)
    except NoCutFits:
        least, at = least_peak(mem.n_layers, n_chunks, chunk_bytes)
        why = (
            f"{key}: no cut into {p.stages} stages fits by the plan's memory model (the least peak is "
            f"{_gib(least)} GiB, at cut {_csv(at)}); raise the budget, lower train.micro_batch_size, or add stages"
        )
        if strict:
            raise ConfigError(why) from None
        return free, f"cut {_csv(free)} (balanced without the budget: {why}; a run with it stops)"
    top = max(range(n_chunks), key=lambda c: totals[c])
    return cut, (
        f"cut {_csv(cut)} (balanced within {key}; unconstrained {_csv(free)} needs {_gib(totals[top])} GiB on "
        f"stage {top})"
    )


def _csv(blocks: list[int]) -> str:
    return ",".join(map(str, blocks))


def _gib(b: float) -> str:
    return f"{b / GIB:.3f}" if b < 10 * GIB else f"{b / GIB:.1f}"  # as the table prints GiB


def budgeted(cfg: Any) -> Any:
    """``cfg`` with a balanced cut under `pipeline.memory_gib` resolved to its blocks per chunk (`cut_within`; a
    copy), so that every reader of `partition.cut_blocks` (the engine, the simulator's per-stage staleness, the
    cost model, the run's record) reads the cut the budget chose; ``cfg`` itself where no budget applies."""
    import copy

    p = cfg.pipeline
    if p.get("memory_gib") is None or p.get("cut", "balanced") != "balanced":
        return cfg
    cut, _ = cut_within(cfg, strict=True)
    out = copy.deepcopy(cfg)
    out.pipeline.cut = cut
    return out


def _notes(cfg: Any, spec: Any, versions: int, runs: bool, deferred: bool) -> list[str]:
    """What the table alone does not say: a toy batch, a delay only the simulator runs, a batch 2BW cannot run,
    a deferred step's second gradient buffer, a tied matrix held twice, a V's upper bound."""
    m, t, P = cfg.model, cfg.train, cfg.pipeline.stages
    notes = [n for n in (batch_note(cfg),) if n]
    if cfg.delay > 1:
        notes.append(f"delay={cfg.delay} runs only in the simulator; weights counted as {versions} versions")
    if not runs:
        notes.append(
            f"engine=pipeline runs 2BW only with train.micro_batches >= pipeline.stages ({t.micro_batches} < {P}): "
            f"set train.micro_batches={P} or more"
        )
    if deferred:
        notes.append("2BW defers each step past the next batch's first backward: two gradient buffers")
    if m.tie_embeddings and spec.chunks == 1 and P > 1:
        notes.append(f"tied embeddings: stage 0 and stage {P - 1} each hold the matrix (gradients summed each step)")
    if spec.chunks > 1:
        notes.append(
            f"{spec.name}: in-flight is the larger chunk's peak; activations add each chunk's own peak "
            "(an upper bound when the peaks do not coincide)"
        )
    return notes


def batch_note(cfg: Any) -> Optional[str]:
    """A warning when the batch is the embedded default (a toy run's) on a model made for longer sequences: a plan
    of a large model at 8 x 64 tokens says little about the run that will happen."""
    from asyncpipe.config.schema import TrainConfig

    t, d = cfg.train, TrainConfig()
    if (t.micro_batch_size, t.seq_len) == (d.micro_batch_size, d.seq_len) and cfg.model.max_seq_len > 4 * t.seq_len:
        return (
            f"batch: the embedded default ({t.micro_batch_size} x {t.seq_len} tokens, a toy run's); model "
            f"'{cfg.model.name}' takes sequences up to {cfg.model.max_seq_len}: plan the real run with "
            f"train.micro_batch_size=... train.seq_len=... (the max mb column: the largest that fits)"
        )
    return None
