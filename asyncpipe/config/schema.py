"""Typed config schemas: the one definition of every key a run accepts.

Values live in `conf/` YAML; these dataclasses give Hydra the types and the set of allowed keys,
so a typo or a wrong type is caught at composition time. The keys an optimizer or a compensation method adds
are declared in its own module (`asyncpipe.registry`); `full_schema` adds them. This module imports no torch, and
neither does `full_schema` (the built-ins' declaring modules, `asyncpipe.optimizers` and `asyncpipe.compensation`,
are torch-free).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, List, Optional

from omegaconf import MISSING


@dataclass
class MoEConfig:
    experts: int = 0  # routed SwiGLU experts E per block (0 = dense MLP)
    top_k: int = 2  # experts each token is sent to
    d_expert: Optional[int] = None  # expert hidden width (None = model.d_ff)
    shared_expert: bool = False  # one always-on SwiGLU expert of width d_expert beside the routed ones
    aux_loss_coef: float = 0.01  # load-balancing loss E * sum_e f_e * P_e, per MoE block, added to the loss
    z_loss_coef: float = 0.001  # router z-loss mean(logsumexp(logits)^2), per MoE block, added to the loss
    capacity_factor: Optional[float] = None  # None = dropless; else each expert takes <= cf * N * k / E tokens


@dataclass
class ModelConfig:
    name: str = MISSING  # preset name, e.g. tiny, small, 135m
    n_layer: int = 2  # transformer blocks
    d_model: int = 64  # residual width
    n_head: int = 4  # attention heads
    n_kv_head: Optional[int] = None  # grouped-query attention: KV heads (None = n_head)
    d_ff: int = 172  # SwiGLU hidden width
    max_seq_len: int = 256  # longest sequence RoPE and validation allow
    vocab_size: Optional[int] = None  # None = the tokenizer's vocabulary size
    tie_embeddings: bool = False  # share input embedding and output head; refused by engine=pipeline
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    moe: MoEConfig = field(default_factory=MoEConfig)  # mixture-of-experts MLPs (moe.experts > 0)


@dataclass
class OptimizerBase:
    """The keys every optimizer has; `OptimizerConfig` (this plus what each declares) is built on access."""

    name: str = MISSING  # a declared optimizer: adamw, muon, nadam, soap, ... (asyncpipe.registry)
    lr: float = 1e-3  # peak learning rate of the main parameter group (YAML default: conf/tuned_lr.yaml)
    weight_decay: float = 0.1
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])  # Adam-style betas
    eps: float = 1e-8
    _target_: Optional[str] = None  # import path of your own optimizer module (docs/extending.md)
    # + each method's switch node optimizer.<key> (`asyncpipe.registry.Switch`) and the keys each optimizer
    # declares (asyncpipe/optimizers/<name>.py), added by `full_schema`


@dataclass
class CompensationBase:
    """`CompensationConfig` (this plus each method's node) is built on access."""

    name: str = "none"  # a declared method: none, dc, ... (`asyncpipe config show` lists them)
    _target_: Optional[str] = None  # import path of your own method module (docs/extending.md)
    # + each method's settings node, declared in its module (asyncpipe/compensation/), added by `full_schema`


@dataclass
class TokenizerConfig:
    name: str = MISSING  # byte, bpe, gpt2, hf (a tokenizer.json), ids (data=tokens made elsewhere)
    vocab_size: int = 256  # bpe: vocabulary to train; byte/gpt2/hf: fixed by the tokenizer; ids: declare it
    path: str = ""  # hf: the tokenizer.json file (Hugging Face `tokenizers`)
    eot: str = ""  # hf: the end-of-text token ("" = the first of <|endoftext|>, <|end_of_text|>, </s>, <eos> it has)


@dataclass
class DataConfig:
    name: str = MISSING  # corpus: hamlet, shakespeare, kjv, docs, mix
    sources: List[str] = field(
        default_factory=list
    )  # docs: Debian packages; mix: its parts (shakespeare, kjv, torchdoc)
    val_fraction: float = 0.1  # share of documents held out for validation
    root: str = "${oc.env:ASYNCPIPE_DATA,data_cache}"  # prepared token files live under here
    split_seed: int = 0  # seed of the document-level train/val split
    paths: List[str] = field(default_factory=list)  # files, tokens: files or globs (asyncpipe/data/sources.py)
    format: str = "auto"  # files: auto (by suffix), text, jsonl, parquet
    text_field: str = "text"  # files (jsonl, parquet) and hf: the text field or column
    separator: str = ""  # files (text): "" = one document per file, else the string between documents
    token_dtype: str = "auto"  # tokens (.bin): uint16, uint32 or auto (uint16 when the vocabulary fits)
    dataset: str = ""  # hf: a dataset name (cache or hub) or a directory written by save_to_disk
    subset: str = ""  # hf: the dataset's config name
    split: str = "train"  # hf: the dataset split read
    workers: int = 1  # files, tokens, hf: processes preparing shards in parallel
    shard_mb: float = (
        64.0  # files, tokens, hf: input megabytes per shard (the unit of work and of resuming; a larger file is cut)
    )


@dataclass
class TrainConfig:
    steps: int = 100  # optimizer steps
    micro_batch_size: int = 8  # sequences per micro-batch
    micro_batches: int = 4  # micro-batches per optimizer step (gradient accumulation)
    seq_len: int = 64  # tokens per sequence
    eval_every: int = 25  # evaluate on val every N steps (and at the end)
    eval_batches: int = 8  # micro-batches per evaluation
    warmup_frac: float = 0.1  # linear warm-up share of steps
    min_lr_frac: float = 0.1  # the schedule decays to this fraction of the peak lr (at the last step)
    lr_schedule: str = (
        "cosine"  # cosine: warm-up, cosine decay; wsd: warm-up, constant, linear decay (asyncpipe/lr_schedule.py)
    )
    decay_frac: float = 0.2  # wsd: share of train.steps in the final linear decay (rounded to whole steps)
    warmup_steps: Optional[int] = (
        None  # warm-up in steps (None = warmup_frac x steps); wsd needs it: every length then shares warm-up and stable phase
    )
    grad_clip: float = 1.0  # global gradient-norm clip (0 = off)
    diverge_loss: float = 20.0  # a train loss above this (or NaN/inf) ends the run as diverged
    log_every: int = 10  # progress line every N steps when not on a terminal
    compile: str = (
        "auto"  # torch.compile the model / stage layers: auto (per device, asyncpipe.model.compile), true, false
    )
    compile_backend: str = (
        "inductor"  # torch.compile backend: inductor, or aot_eager (graphs traced, kernels eager: a quick check)
    )
    deterministic: bool = False  # torch.use_deterministic_algorithms: same bits run to run and on resume on CUDA too (slower; an op without a deterministic kernel stops the run)


@dataclass
class StandinConfig:
    """Stand-in compute (`asyncpipe bench pipeline --standin`): each stage's forward and backward per micro-batch
    last this long, the (tiny) real op padded by a wait (a V's two chunks half each), so compute time is known."""

    forward_s: float = 0.0  # seconds a stage's forward lasts per micro-batch (0: real compute only)
    backward_s: float = 0.0  # seconds its backward lasts (one that recomputes its forward: forward_s more)
    # per-layer stand-in instead: each layer waits its own seconds from conf/standin/NAME.yaml (or a path), a stage
    # the sum over its cut's layers (`asyncpipe.standin_costs`); None: off
    profile: Optional[str] = None
    scale: float = 1.0  # the profile's seconds times this


@dataclass
class PipelineConfig:
    stages: int = 2  # pipeline stages P (engine=pipeline; also the depth of delay_profile=pipedream)
    data_parallel: int = 1  # replicas D per stage: world = P * D
    clip: str = "global"  # global: one norm over all stages; stage: each stage clips its own
    trace: bool = False  # record per-instruction events (RUN/trace-rank{r}.json) for `asyncpipe schedule`
    defer_step: Optional[bool] = (
        None  # 2BW: step just before W(b+1) is first read, hiding the norm all-reduce (None = when needed)
    )
    backend: str = "auto"  # auto: nccl on CUDA, gloo on CPU
    threads: int = 1  # torch threads per process
    standin: StandinConfig = field(default_factory=StandinConfig)  # 0, 0: off (real compute only)
    # 1f1b, 2bw, dualpipev, pipedream, paci (asyncpipe.schedules) or pkg.module; auto: 1f1b at delay 0, 2bw above
    schedule: str = "auto"
    torch_schedule: Optional[str] = (
        None  # run PyTorch's own schedule instead (torch.distributed.pipelining: 1f1b, interleaved1f1b, loopedbfs, interleavedzb, zbv, dualpipev; delay 0)
    )
    cut: Any = "balanced"  # stage cut: balanced (slowest stage least, by FLOPs), even, or [blocks per stage] (asyncpipe.partition)
    memory_gib: Optional[float] = (
        None  # balanced cut within this many GiB per device by `asyncpipe plan`'s memory model (null: no budget)
    )


@dataclass
class RunConfig:
    dir: str = "runs/${now:%Y%m%d-%H%M%S}-${model.name}-${run_tag:${optimizer.name},${compensation.name}}-d${delay}"  # run directory
    name: Optional[str] = None  # display name (default: the run dir's name)
    variant: Optional[str] = (
        None  # the sweep file variant this run belongs to (set by `asyncpipe sweep`; report columns)
    )
    branch_from: Optional[str] = (
        None  # wsd: a longer run's dir; start from its checkpoint at this run's decay start (sweep budgets:)
    )


@dataclass
class WandbConfig:
    mode: str = "auto"  # auto (online with an API key, else offline), online, offline, disabled
    project: str = "asyncpipe"
    entity: Optional[str] = None
    group: Optional[str] = None  # sweeps set this to the sweep name
    tags: List[str] = field(default_factory=list)


@dataclass
class TrackerConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class CheckpointConfig:
    every: int = 0  # steps between checkpoints (0 = only when SIGTERM/SIGUSR1/SIGUSR2 arrives)
    keep: int = 2  # complete checkpoints kept
    branches: List[int] = field(
        default_factory=list
    )  # wsd: train.steps of shorter runs branching off this one; their decay starts are checkpointed and kept


@dataclass
class DiagnosticsConfig:
    fresh_grad_every: int = 0  # every N steps log cos(stale grad, fresh grad); 0 = off


@dataclass
class LauncherConfig:
    name: str = MISSING  # local or slurm
    parallel: int = 1  # local: runs at once
    partition: Optional[str] = None
    account: Optional[str] = None
    qos: Optional[str] = None
    nodes: int = 1
    gpus_per_node: int = 0
    tasks_per_node: int = 1
    cpus_per_task: int = 1
    mem_gb: Optional[int] = None
    timeout_min: int = 60
    array_parallelism: int = 64
    extra: Any = field(default_factory=dict)  # extra sbatch parameters (name: value)
    socket_ifname: Optional[str] = None  # slurm: GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME of the tasks (e.g. ib0)


@dataclass
class Config:
    model: ModelConfig = MISSING
    optimizer: OptimizerBase = MISSING
    compensation: CompensationBase = field(default_factory=CompensationBase)
    tokenizer: TokenizerConfig = MISSING
    data: DataConfig = MISSING
    launcher: LauncherConfig = MISSING
    train: TrainConfig = field(default_factory=TrainConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    run: RunConfig = field(default_factory=RunConfig)
    tracker: TrackerConfig = field(default_factory=TrackerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    diagnostics: DiagnosticsConfig = field(default_factory=DiagnosticsConfig)
    delay: int = 0  # optimizer-step staleness k: 0 = synchronous, 1 = PipeDream-2BW
    delay_profile: str = "uniform"  # uniform (2BW) or pipedream (stage s delayed P-1-s)
    engine: str = "simulate"  # simulate (one process, exact delay) or pipeline (DeepSpeed)
    seed: int = 0
    device: str = "auto"  # auto, cpu, cuda
    precision: str = "auto"  # auto (bf16 autocast on CUDA, fp32 on CPU), fp32, bf16
    resume: bool = False  # continue from the run dir's latest complete checkpoint


def _merged(base: type, extra: list[tuple[str, type]], name: str) -> type:
    """``base`` with the fields of the ``extra`` dataclasses added: flat (``extra`` as ``("", cls)``) or as a
    node ``key: cls``. A flat field two declarations share must have one type."""
    hints = typing.get_type_hints(base)
    fields: dict[str, tuple] = {f.name: (f.name, hints[f.name], _default(f)) for f in dataclasses.fields(base)}
    for key, cls in extra:
        if key:
            fields.setdefault(key, (key, cls, field(default_factory=cls)))
            continue
        for f in dataclasses.fields(cls):
            kind = typing.get_type_hints(cls)[f.name]
            if f.name in fields and fields[f.name][1] != kind:
                raise ValueError(f"{name}.{f.name} is declared as {fields[f.name][1]} and as {kind} ({cls.__name__})")
            fields.setdefault(f.name, (f.name, kind, _default(f)))
    return dataclasses.make_dataclass(name, list(fields.values()))


def _default(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return field(default_factory=f.default_factory)  # type: ignore[misc]
    return field(default=f.default)


def full_schema() -> type:
    """`Config` with the keys every declared optimizer adds to ``optimizer.*`` (flat), every declared method's
    settings node ``compensation.<key>`` and its switch's node ``optimizer.<key>``, if it has one (`asyncpipe.registry`;
    the built-ins' declarations import no torch)."""
    from asyncpipe import registry

    declared = tuple((s.name, s.module) for s in registry.optimizers() + registry.methods())
    if declared not in _BUILT:  # the same classes while the declarations are the same (OmegaConf merges by class)
        _BUILT[declared] = _build(registry)
    return _BUILT[declared]


_BUILT: dict[tuple, type] = {}


def _build(registry: Any) -> type:
    switches = [(m.switch.key, m.switch.config) for m in registry.methods() if m.switch is not None]
    flat = [("", s.config) for s in registry.optimizers() if s.config]
    opt = _merged(OptimizerBase, switches + flat, "OptimizerConfig")
    comp = _merged(
        CompensationBase, [(m.key, m.config) for m in registry.methods() if m.key and m.config], "CompensationConfig"
    )
    hints = {**typing.get_type_hints(Config), "optimizer": opt, "compensation": comp}
    fields = [
        (f.name, hints[f.name], field(default_factory=comp) if f.name == "compensation" else _default(f))
        for f in dataclasses.fields(Config)
    ]
    return dataclasses.make_dataclass("Config", fields)


def __getattr__(name: str) -> type:
    """``OptimizerConfig`` / ``CompensationConfig``: the full dataclasses of the declared components."""
    if name in ("OptimizerConfig", "CompensationConfig"):
        key = "optimizer" if name == "OptimizerConfig" else "compensation"
        return typing.get_type_hints(full_schema())[key]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
