"""Value checks a type system cannot express: each failure is one line naming the key, the value and what is allowed."""

from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from typing import Any, Iterable

from omegaconf import DictConfig, OmegaConf

from asyncpipe.config.keys import leaves
from asyncpipe.errors import ConfigError, UserError
from asyncpipe.lr_schedule import SCHEDULES, LRSchedule

ENGINES = ("simulate", "pipeline")
DELAY_PROFILES = ("uniform", "pipedream")
DEVICES = ("auto", "cpu", "cuda")
PRECISIONS = ("auto", "fp32", "bf16")
CLIP_MODES = ("global", "stage")
BACKENDS = ("auto", "gloo", "nccl")
COMPILE_BACKENDS = ("inductor", "aot_eager")  # train.compile_backend (asyncpipe.model.compile.compile_modules)
WANDB_MODES = ("auto", "online", "offline", "disabled")


def _need(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _choice(key: str, value: object, allowed: tuple) -> None:
    _need(value in allowed, f"{key}={value} is not allowed; choose one of: {', '.join(map(str, allowed))}")


def validate(cfg: DictConfig) -> None:
    """Raise `ConfigError` for the first impossible value in a composed config."""
    check_known_keys(cfg)
    check_finite(cfg)
    check_ranges(cfg)
    check_choices(cfg)
    check_training(cfg)
    check_model(cfg)
    check_pipeline_sizes(cfg)
    _validate_compensation(cfg)
    check_stage_cut(cfg)


def check_choices(cfg: DictConfig) -> None:
    """Every key that takes one of a fixed list of names."""
    t, p = cfg.train, cfg.pipeline
    _choice("engine", cfg.engine, ENGINES)
    _choice("delay_profile", cfg.delay_profile, DELAY_PROFILES)
    _choice("device", cfg.device, DEVICES)
    _choice("precision", cfg.precision, PRECISIONS)
    _choice("pipeline.clip", p.clip, CLIP_MODES)
    _choice("pipeline.backend", p.backend, BACKENDS)
    _choice("tracker.wandb.mode", cfg.tracker.wandb.mode, WANDB_MODES)
    _choice("train.compile_backend", t.compile_backend, COMPILE_BACKENDS)


def check_training(cfg: DictConfig) -> None:
    """The delay, the optimizer's lr and weight decay, the run's sizes, its lr schedule and budget branches."""
    t, o = cfg.train, cfg.optimizer
    _need(cfg.delay >= 0, f"delay={cfg.delay} must be >= 0 (0 = synchronous, 1 = PipeDream-2BW)")
    _need(o.lr > 0, f"optimizer.lr={o.lr} must be > 0")
    _need(o.weight_decay >= 0, f"optimizer.weight_decay={o.weight_decay} must be >= 0")
    _need(
        o.lr * o.weight_decay < 1,
        f"optimizer.lr={o.lr:g} x optimizer.weight_decay={o.weight_decay:g} >= 1: decoupled "
        "decay multiplies every weight by 1 - lr x weight_decay <= 0 each step (weights zeroed or sign-flipped)",
    )
    for key in ("steps", "micro_batch_size", "micro_batches", "seq_len", "eval_every", "eval_batches", "log_every"):
        _need(t[key] >= 1, f"train.{key}={t[key]} must be >= 1")
    _need(0 <= t.warmup_frac < 1, f"train.warmup_frac={t.warmup_frac} must be in [0, 1)")
    _need(0 <= t.min_lr_frac <= 1, f"train.min_lr_frac={t.min_lr_frac} must be in [0, 1]")
    check_lr_schedule(t)
    check_branches(cfg)
    _need(t.grad_clip >= 0, f"train.grad_clip={t.grad_clip} must be >= 0 (0 = off)")


def check_model(cfg: DictConfig) -> None:
    """The model's shape against the run's sequence length, its heads, and its mixture of experts."""
    m, t = cfg.model, cfg.train
    _need(
        t.seq_len <= m.max_seq_len,
        f"train.seq_len={t.seq_len} exceeds model '{m.name}' maximum of {m.max_seq_len} (model.max_seq_len)",
    )
    _need(m.n_layer >= 1 and m.d_model >= 1 and m.n_head >= 1, f"model '{m.name}' needs n_layer, d_model, n_head >= 1")
    _need(m.d_model % m.n_head == 0, f"model.d_model={m.d_model} must be divisible by model.n_head={m.n_head}")
    kv = m.n_kv_head or m.n_head
    _need(m.n_head % kv == 0, f"model.n_head={m.n_head} must be divisible by model.n_kv_head={kv}")
    moe = m.moe
    if moe.experts:
        _need(moe.experts >= 1, f"model.moe.experts={moe.experts} must be >= 0 (0 = dense)")
        _need(
            1 <= moe.top_k <= moe.experts,
            f"model.moe.top_k={moe.top_k} must be in [1, model.moe.experts={moe.experts}]",
        )
        _need(
            moe.d_expert is None or moe.d_expert >= 1,
            f"model.moe.d_expert={moe.d_expert} must be >= 1 (or null = d_ff)",
        )
        _need(moe.aux_loss_coef >= 0 and moe.z_loss_coef >= 0, "model.moe.aux_loss_coef and z_loss_coef must be >= 0")
        _need(
            moe.capacity_factor is None or moe.capacity_factor > 0,
            f"model.moe.capacity_factor={moe.capacity_factor} must be > 0 (or null = dropless)",
        )
        check_capacity(cfg)


def check_pipeline_sizes(cfg: DictConfig) -> None:
    """Stages, replicas and threads, the stand-in stage times (engine=pipeline on a declared schedule only),
    checkpoint cadence and the diagnostics' cadence."""
    p = cfg.pipeline
    _need(p.stages >= 1 and p.data_parallel >= 1, "pipeline.stages and pipeline.data_parallel must be >= 1")
    _need(p.threads >= 1, f"pipeline.threads={p.threads} must be >= 1")
    standin = p.get("standin") or {}
    for key in ("forward_s", "backward_s"):
        v = float(standin.get(key, 0.0))
        _need(math.isfinite(v) and 0 <= v <= 60, f"pipeline.standin.{key}={v} must be a time in [0, 60] seconds")
    from asyncpipe.standin_costs import standin_problem

    why = standin_problem(cfg)
    _need(not why, why)
    if any(float(standin.get(k, 0.0)) > 0 for k in ("forward_s", "backward_s")) or standin.get("profile"):
        _need(
            cfg.engine == "pipeline" and p.get("torch_schedule") is None,
            "pipeline.standin runs only in engine=pipeline on a declared schedule (not engine=simulate, "
            "not pipeline.torch_schedule)",
        )
    _need(cfg.checkpoint.every >= 0 and cfg.checkpoint.keep >= 1, "checkpoint.every must be >= 0, checkpoint.keep >= 1")
    _need(cfg.diagnostics.fresh_grad_every >= 0, "diagnostics.fresh_grad_every must be >= 0")
    gib = cfg.pipeline.memory_gib
    _need(gib is None or gib > 0, f"pipeline.memory_gib={gib} must be > 0 (GiB per device; null: no budget)")


def check_stage_cut(cfg: DictConfig) -> None:
    """A staged run's cut into stages and tied embeddings across them, the schedule's own declared constraints,
    and a PyTorch schedule's (`pipeline.torch_schedule`)."""
    m, p = cfg.model, cfg.pipeline
    from asyncpipe.schedules import check as check_schedule
    from asyncpipe.schedules import resolve, staged

    if cfg.engine == "pipeline" or staged(resolve(cfg), p.stages, cfg.delay):
        _need(
            p.stages <= m.n_layer,
            f"pipeline.stages={p.stages} exceeds the {m.n_layer} transformer blocks of model '{m.name}'",
        )
        from asyncpipe.partition import cut_problem

        _need(not cut_problem(cfg), cut_problem(cfg))  # a bad pipeline.cut list: one line
    if cfg.engine == "pipeline" and m.tie_embeddings:
        from asyncpipe.partition import tied_problem

        _need(not tied_problem(cfg), tied_problem(cfg))  # tied across stages: 1F1B and 2BW (`engines.pipeline.tied`)
    check_schedule(cfg)  # the schedule's declaration (`asyncpipe.schedules`): engines, delay, clipping, methods, P, m
    if p.get("torch_schedule") is not None:
        from asyncpipe.torch_schedules import config_problem

        problem = config_problem(cfg)
        _need(problem is None, str(problem))


# -- numbers in range, keys that exist: separate from `validate`'s body to keep each check findable --

INFINITE_OK = ("train.diverge_loss",)  # inf = no loss threshold (NaN/inf losses still end the run)


def check_finite(cfg: DictConfig) -> None:
    """No NaN or infinity anywhere (`optimizer.lr=inf` would train on NaNs), except where inf means "off"."""
    for key, value in leaves(cfg, index_lists=True):
        if isinstance(value, float) and not math.isfinite(value) and not (value == math.inf and key in INFINITE_OK):
            _need(False, f"{key}={value} must be a finite number")


def check_ranges(cfg: DictConfig) -> None:
    """Optimizer hyper-parameters, thresholds and launcher sizes the optimizers or launchers would reject late."""
    o, m, t, ln = cfg.optimizer, cfg.model, cfg.train, cfg.launcher
    _need(str(cfg.run.dir).strip() != "", "run.dir is empty; give the run its own directory, e.g. run.dir=runs/NAME")
    betas = list(o.betas)
    _need(len(betas) == 2, f"optimizer.betas={betas} needs two values, e.g. optimizer.betas=[0.9,0.95]")
    for i, beta in enumerate(betas):
        _need(0 <= beta < 1, f"optimizer.betas={betas}: beta{i + 1}={beta} must be in [0, 1)")
    _need(o.eps > 0, f"optimizer.eps={o.eps} must be > 0")
    _need(t.diverge_loss > 0, f"train.diverge_loss={t.diverge_loss} must be > 0 (a train loss above it ends the run)")
    _need(0 < cfg.data.val_fraction < 1, f"data.val_fraction={cfg.data.val_fraction} must be in (0, 1)")
    for key in ("d_ff", "max_seq_len"):
        _need(m[key] >= 1, f"model.{key}={m[key]} must be >= 1")
    _need(
        m.vocab_size is None or m.vocab_size >= 1,
        f"model.vocab_size={m.vocab_size} must be >= 1 (or null = the tokenizer's)",
    )
    for key in ("rope_theta", "norm_eps", "init_std"):
        _need(m[key] > 0, f"model.{key}={m[key]} must be > 0")
    for key in ("parallel", "nodes", "tasks_per_node", "cpus_per_task", "timeout_min", "array_parallelism"):
        _need(ln[key] >= 1, f"launcher.{key}={ln[key]} must be >= 1")
    _need(ln.gpus_per_node >= 0, f"launcher.gpus_per_node={ln.gpus_per_node} must be >= 0")
    _need(
        ln.mem_gb is None or ln.mem_gb >= 1, f"launcher.mem_gb={ln.mem_gb} must be >= 1 (or null = the cluster default)"
    )


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """`; did you mean 'x'?` for the closest choice, or nothing."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else ""


def check_lr_schedule(t: DictConfig) -> None:
    """`train.lr_schedule` and its keys: wsd needs its warm-up in steps (so every length shares it), and the
    warm-up may not run into the decay (`asyncpipe.lr_schedule.LRSchedule`)."""
    _choice("train.lr_schedule", t.lr_schedule, SCHEDULES)
    _need(0 < t.decay_frac < 1, f"train.decay_frac={t.decay_frac} must be in (0, 1)")
    _need(t.warmup_steps is None or t.warmup_steps >= 0, f"train.warmup_steps={t.warmup_steps} must be >= 0 (or null)")
    _need(
        t.lr_schedule != "wsd" or t.warmup_steps is not None,
        "train.lr_schedule=wsd needs train.warmup_steps (its warm-up in steps, e.g. 10% of the shortest run's "
        "steps), so runs of every train.steps share warm-up and stable phase",
    )
    try:
        LRSchedule.of(t)
    except UserError as err:
        raise ConfigError(str(err)) from None


def check_branches(cfg: DictConfig) -> None:
    """A budget branch (`run.branch_from`) and its parent (`checkpoint.branches`) share a wsd stable phase."""
    t, branches = cfg.train, list(cfg.checkpoint.branches)
    if cfg.run.branch_from is not None or branches:
        key = "run.branch_from" if cfg.run.branch_from is not None else "checkpoint.branches"
        _need(
            t.lr_schedule == "wsd",
            f"{key} needs train.lr_schedule=wsd (runs of different lengths share only a "
            f"wsd schedule's steps before its decay; got {t.lr_schedule})",
        )
        _need(
            str(t.compile).lower() != "auto",
            f"{key} needs train.compile=true or false: auto compiles by the "
            "run's length (CPU runs of 2000 steps or more), so a branch and its parent could differ",
        )
    bad = [b for b in branches if not 1 <= b < t.steps]
    _need(
        not bad,
        f"checkpoint.branches={branches}: each is the train.steps of a shorter run, in [1, train.steps={t.steps})",
    )
    for steps in branches:
        try:
            LRSchedule.of(t).at_steps(steps)
        except UserError as err:
            raise ConfigError(f"checkpoint.branches: a run of {steps} steps: {err}") from None


def check_known_keys(cfg: DictConfig, prefix: str = "") -> None:
    """Refuse keys the schema does not have: Hydra's `+key=value` adds them even to typed groups, so a typo
    like `+optimizer.lrr=1` would otherwise be accepted and recorded in config.yaml. Free-form nodes (typed
    `Any` or `dict` in the schema, e.g. `launcher.extra`) accept any key."""
    schema = OmegaConf.get_type(cfg)
    if not dataclasses.is_dataclass(schema):
        return
    fields = [f.name for f in dataclasses.fields(schema)]
    for key in cfg.keys():
        name = f"{prefix}{key}"
        if key not in fields:
            hint = did_you_mean(name, [prefix + f for f in fields]) or "; see `asyncpipe config show` for the keys"
            _need(False, f"unknown config key '{name}' (added with +){hint}")
        child = cfg[key]
        if isinstance(child, DictConfig):
            check_known_keys(child, name + ".")


def suggest_key(full_key: str) -> str:
    """`; did you mean 'train.steps'?` for a dotted key the schema lacks (e.g. `train.stepz`), or nothing."""
    from asyncpipe.config.schema import Config

    *parents, _ = full_key.split(".")
    node: Any = Config
    for part in parents:
        node = typing.get_type_hints(node).get(part)
        if not dataclasses.is_dataclass(node):
            return ""
    prefix = "".join(f"{p}." for p in parents)
    return did_you_mean(full_key, [prefix + f.name for f in dataclasses.fields(node)])


MIN_KEPT = 0.01  # a capacity that keeps fewer token-expert assignments than this trains experts on almost nothing


def check_capacity(cfg: DictConfig) -> None:
    """An MoE capacity so small that > 99% of a micro-batch's token-expert assignments are dropped: each expert
    takes max(1, ceil(cf x n x k / E)) of the n x k assignments (`asyncpipe.model.moe`), n = tokens per
    micro-batch; the dropped tokens skip the MLP, so the run trains its experts on almost nothing."""
    moe, t = cfg.model.moe, cfg.train
    if moe.capacity_factor is None:
        return
    n, k, e = t.micro_batch_size * t.seq_len, moe.top_k, moe.experts
    kept = min(1.0, e * max(1, math.ceil(moe.capacity_factor * n * k / e)) / (n * k))
    _need(
        kept >= MIN_KEPT,
        f"model.moe.capacity_factor={moe.capacity_factor:g} keeps at most {kept:.2%} of each "
        f"micro-batch's {n} x {k} token-expert assignments (> 99% dropped); use >= {MIN_KEPT:g} "
        f"(1 = a balanced load), or null = dropless",
    )


def check_declared(cfg: DictConfig) -> None:
    """The checks the run's optimizer and compensation method declare (`asyncpipe.registry`), and what holds for
    every method: one that fits only the simulator is refused by engine=pipeline; one that needs a delay is an
    exact no-op at delay 0 and is refused there (a report would show it as a column of its own)."""
    from asyncpipe.registry import method_spec, optimizer_spec, target_of

    o = cfg.optimizer
    opt = optimizer_spec(o.name, target_of(o))
    if opt.check is not None:
        opt.check(o, cfg)
    comp = cfg.compensation
    method = method_spec(comp.name, target_of(comp))
    _need(
        cfg.delay > 0 or not method.needs_delay,
        f"compensation={method.name} at delay=0 computes exactly the plain optimizer (there is no staleness to correct): use it with "
        f"delay >= 1, or compensation=none",
    )
    _need(
        cfg.engine != "pipeline" or method.fits_2bw,
        f"compensation={method.name} does not run in engine=pipeline: {method.note}; use engine=simulate",
    )
    if method.check is not None:
        method.check(comp[method.key] if method.key else comp, cfg)


def _validate_compensation(cfg: DictConfig) -> None:
    """Checks of the `compensation` group (`check_declared`). A method's switch (``optimizer.<key>.enabled``) was
    resolved into ``compensation=<method>`` at composition (`asyncpipe.config.alias`); a config built another way
    that still holds it is refused rather than run without the method."""
    from asyncpipe.config.alias import switched_on

    method = switched_on(cfg)
    if method is not None and method.switch is not None:
        raise ConfigError(
            f"optimizer.{method.switch.key}.enabled=true was not resolved: compose the config with "
            f"asyncpipe.config.compose (or resolve_switch), which makes it compensation={method.name}"
        )
    check_declared(cfg)


def check_delay_fits(cfg: DictConfig) -> None:
    """A run (`asyncpipe train`, a sweep's runs) whose delay reaches train.steps is no study of staleness: every
    update would use gradients of the initial weights. Not part of `validate`: a benchmark's one-step warm-up job
    runs at delay 1 on purpose."""
    _need(
        cfg.delay < cfg.train.steps,
        f"delay={cfg.delay} with train.steps={cfg.train.steps}: every update would use "
        "gradients of the initial weights (the first `delay` steps do); use a delay below train.steps",
    )
