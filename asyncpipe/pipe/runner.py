"""Run `engine=pipeline`: `run_pipeline` is what every rank process executes (under torchrun, SLURM or
`launch_local`); `launch_local` trains one config in P x D processes on this machine (see `pipe.local`).

Data order matches the simulator: step t, replica r, micro-batch j reads global micro-batch t*m*D + r*m + j, so
P stages x D replicas with m micro-batches each equals `engine=simulate` with m*D micro-batches.
Checkpoints (`checkpoint.every`, stop signals), resume=true and divergence act at batch cuts (`pipe.faults`).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence, Union

from omegaconf import DictConfig

from asyncpipe.errors import UserError

StepCallback = Callable[[dict], None]


def rank_env() -> tuple[int, int, int]:
    """(rank, world size, local rank) of this process, from torchrun's / submitit's environment."""
    from asyncpipe.dist import rank_env as env

    found = env()
    if found is None:
        raise UserError("engine=pipeline ranks need RANK and WORLD_SIZE in the environment (torchrun, SLURM, launch_local)")
    os.environ.setdefault("LOCAL_RANK", str(found[2]))  # DeepSpeed's PipelineModule reads it
    return found


def _train_stream(data: Any, m: int, replicas: int, replica: int, steps: int, start: int = 0) -> Iterator[tuple]:
    for t in range(start, steps):
        for j in range(m):
            yield data.get(t * m * replicas + replica * m + j)


def _val_indices(n: int, replicas: int, replica: int) -> list[int]:
    # Equal shares keep "mean of replica means" equal to the simulator's mean; otherwise every replica does all.
    return list(range(replica, n, replicas)) if n % replicas == 0 else list(range(n))


def refuse_unsupported(cfg: DictConfig) -> None:
    """What engine=pipeline cannot do yet, as one-line user errors before any process starts."""
    if cfg.model.tie_embeddings:
        raise UserError("engine=pipeline needs untied embeddings; set model.tie_embeddings=false")
    if cfg.delay not in (0, 1) or cfg.delay_profile != "uniform":
        raise UserError(f"engine=pipeline runs delay 0 or 1 with delay_profile=uniform, got delay={cfg.delay}")


def run_pipeline(
    cfg: DictConfig,
    run_dir: Union[str, os.PathLike, None] = None,
    on_step: Optional[StepCallback] = None,
    stop: Any = None,
    log: Optional[Callable[[str], None]] = None,
) -> dict:
    """Train this rank's share of an `engine=pipeline` run; returns the run summary on rank 0 (this rank's
    stage summary elsewhere). Rank 0 writes `metrics.jsonl` / `summary.json` to ``run_dir`` when given and
    calls ``on_step(metrics)`` per step (metrics may arrive a step late: no rank ever waits for them).

    ``stop``: a `StopRequest` already installed by the caller (else one is installed here): a signal on any
    rank checkpoints every rank at the next agreed cut and ends the run as ``interrupted``. ``log``: rank 0's
    messages (resume, checkpoints; default print)."""
    import torch
    import torch.distributed as tdist

    from asyncpipe.train.runtime import pick_device

    refuse_unsupported(cfg)
    rank, world, local = rank_env()
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(k)]
    if missing and not tdist.is_initialized():
        raise UserError(f"engine=pipeline needs {' and '.join(missing)} in the environment (the rendezvous of rank 0)")
    p = cfg.pipeline
    if world != p.stages * p.data_parallel:
        raise UserError(
            f"world size {world} != pipeline.stages {p.stages} x pipeline.data_parallel {p.data_parallel}"
        )
    device = pick_device(cfg.device)
    if device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed picks an accelerator
    elif device.type == "cuda":
        torch.cuda.set_device(local)
    torch.set_num_threads(p.threads)
    backend = p.backend if p.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
    from asyncpipe.pipe.stage import init_comm

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    init_comm(backend, float(os.environ.get("ASYNCPIPE_PG_TIMEOUT", "1800")))
    return _train(cfg, rank, device, run_dir, on_step, stop, log or print)


def build_engine(cfg: DictConfig, rank: int, device: Any, vocab: int) -> tuple[Any, int, int]:
    """This rank's `TwoBWPipelineEngine` over its stage of the model; returns (engine, stage, replica)."""
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

    from asyncpipe.model import build_layers, lm_loss, set_aux_grad_scale, stage_layers
    from asyncpipe.optim import build_optimizer
    from asyncpipe.pipe import memory
    from asyncpipe.pipe.engine import PipeSettings, TwoBWPipelineEngine
    from asyncpipe.pipe.stage import StagedModule, deepspeed_config

    t, p = cfg.train, cfg.pipeline
    topo = PipeDataParallelTopology(num_pp=p.stages, num_dp=p.data_parallel)
    coord = topo.get_coord(rank)
    v_shape = p.schedule == "dualpipev"
    parts, mine = stage_layers(cfg.model.n_layer + 2, p.stages, coord.pipe, v_shape)
    baseline = memory.mark(device)  # the stage's peak memory is measured from here (stage_summary)
    # Only this stage's layers are built, each from (seed, layer index): the simulator's initial weights.
    layers = build_layers(cfg.model, vocab, seed=cfg.seed, indices=mine)
    engine_cls: Any = TwoBWPipelineEngine
    module_cls: Any = StagedModule
    if v_shape:
        from asyncpipe.pipe.dualpipev import DualPipeVModule, DualPipeVRunEngine

        engine_cls, module_cls = DualPipeVRunEngine, DualPipeVModule
    with contextlib.redirect_stdout(io.StringIO()):  # DeepSpeed prints its seed and topology settings
        module = module_cls(layers, parts, topo, lm_loss)
    set_aux_grad_scale(module, 1.0 / t.micro_batches)  # MoE aux losses: scaled as DeepSpeed scales the LM loss
    optimizer = build_optimizer(module, cfg.optimizer, compensation=cfg.compensation, delays=cfg.delay, pipeline=True)
    bf16 = cfg.precision == "bf16" or (cfg.precision == "auto" and device.type == "cuda")
    ds_config = deepspeed_config(t.micro_batch_size, t.micro_batches, p.data_parallel, bf16)
    settings = PipeSettings(
        delay=cfg.delay, total_steps=t.steps, max_norm=t.grad_clip, clip=p.clip, warmup_frac=t.warmup_frac,
        min_lr_frac=t.min_lr_frac, trace=p.trace, defer_step=p.defer_step,
    )  # fmt: skip
    mpu = module.mpu()
    engine = engine_cls(
        args=None, model=module, optimizer=optimizer, mpu=mpu, dist_init_required=False, config=ds_config,
        config_class=DeepSpeedConfig(ds_config, mpu), settings=settings,
    )  # fmt: skip
    engine.memory_baseline = baseline
    return engine, coord.pipe, coord.data


def _train(
    cfg: DictConfig, rank: int, device: Any, run_dir: Any, on_step: Optional[StepCallback], stop: Any,
    log: Callable[[str], None],
) -> dict:
    import torch.distributed as tdist

    from asyncpipe.data import MicroBatches, dataset_dir, ensure_prepared, load_manifest
    from asyncpipe.errors import EXIT_DIVERGED, EXIT_INTERRUPTED
    from asyncpipe.pipe import faults
    from asyncpipe.train.loop import diverged
    from asyncpipe.train.runtime import vocab_size_for
    from asyncpipe.train.signals import StopRequest

    started = time.perf_counter()
    t, p = cfg.train, cfg.pipeline
    D, world = p.data_parallel, tdist.get_world_size()
    say = log if rank == 0 else (lambda _: None)
    # One rank prepares the data; the others wait for it rather than race to write the same files.
    if rank == 0:
        data_path = ensure_prepared(cfg.data, cfg.tokenizer)
    tdist.barrier()
    if rank != 0:
        data_path = dataset_dir(cfg.data, cfg.tokenizer)
    engine, stage, replica = build_engine(cfg, rank, device, vocab_size_for(cfg.model, load_manifest(data_path)))
    # Agreement at cuts and checkpoint barriers on a CPU group of their own, whatever the device.
    control_group = tdist.new_group(list(range(world)), backend="gloo")
    control = faults.CutControl(control_group, engine.is_last_stage())
    start = 0
    if cfg.resume:
        resumed = faults.resume(engine, cfg, run_dir, rank, world, control_group, say)
        start = engine.global_steps
        if rank == 0:
            from asyncpipe.track import RunDir

            RunDir(run_dir).truncate_metrics(after_step=start if resumed is not None else -1)

    train_data = MicroBatches(data_path, "train", t.seq_len, t.micro_batch_size, cfg.seed)
    val_data = MicroBatches(data_path, "val", t.seq_len, t.micro_batch_size, 0)  # the simulator's val set
    val_idx = _val_indices(t.eval_batches, D, replica)
    tokens_per_step = t.micro_batch_size * t.micro_batches * D * t.seq_len

    def evaluate() -> float:
        return engine.evaluate(iter([val_data.get(i) for i in val_idx]), len(val_idx))

    tracker = None
    if rank == 0 and run_dir is not None:
        from asyncpipe.track import Tracker

        tracker = Tracker(cfg, run_dir, rank=0)
    val_at: dict[int, float] = {}
    history: list[dict] = []
    status, final_val, save_s = "completed", math.nan, []

    def emit(records: list[dict]) -> None:
        nonlocal status
        for rec in records:
            if status == "diverged":
                break  # the record ends at the first diverged step, as the simulator's does
            rec["tokens"] = rec["step"] * tokens_per_step
            rec["tokens_per_s"] = tokens_per_step / max(rec["step_time"], 1e-9)
            if rec["step"] in val_at:
                rec["val_loss"] = val_at[rec["step"]]
            if diverged(rec["train_loss"], t.diverge_loss):
                status = "diverged"
            history.append(rec)
            if tracker is not None:
                tracker.log(rec)
            if on_step is not None:
                on_step(rec)

    if start == 0:
        final_val = evaluate()
        if rank == 0:
            val_at[0] = final_val
            if tracker is not None:
                tracker.log({"step": 0, "tokens": 0, "val_loss": final_val})
    engine.set_dataiterator(_train_stream(train_data, t.micro_batches, D, replica, t.steps, start))
    every = cfg.checkpoint.every
    try:
        with contextlib.nullcontext(stop) if stop is not None else StopRequest() as stop:
            for step in range(start + 1, t.steps + 1):
                eval_now = step % t.eval_every == 0 or step == t.steps
                save_now = bool(every) and step % every == 0 and step < t.steps and run_dir is not None
                engine.train_batch(sync=eval_now or save_now)  # a deferred step lands before weights are read
                seen = control.exchange(stop.requested, engine.last_loss)  # what every rank knew one cut ago
                blown = seen.loss is not None and diverged(seen.loss, t.diverge_loss)
                halt = step < t.steps and (seen.stop or blown)
                if halt:
                    engine.apply_pending()
                if eval_now:
                    final_val = evaluate()  # collective: every rank is between the same two steps here
                    val_at[step] = final_val
                # At a sync'd cut every rank has applied every step: rank 0 collects them all (before a checkpoint
                # is marked complete, so a resumed run's metrics.jsonl has every step up to it).
                emit(engine.poll_metrics(synced=eval_now or save_now or halt))
                if halt and blown:
                    status = "diverged"
                    say(f"diverged at step {step - 1}: train loss {seen.loss}")
                    break
                path = None
                if (save_now or halt) and run_dir is not None:  # no run dir (a benchmark): nothing to resume
                    path, took = faults.save(engine, cfg, run_dir, rank, world, control_group)
                    save_s.append(took)
                if halt:
                    status = "interrupted"
                    say(f"{stop.signal_name or 'stop'}: checkpoint {path} written; resume=true continues")
                    break
            control.finish()
        emit(engine.poll_metrics(synced=True))
    except BaseException:
        if tracker is not None:
            tracker.finish({"status": "failed", "wall_time": time.perf_counter() - started})
        raise
    if p.trace and run_dir is not None:
        # One file per rank: (instruction, micro-batch, start, end) on this host's monotonic clock.
        events = [{"stage": stage, "replica": replica, "op": n, "micro_batch": k, "start": a, "end": e}
                  for n, k, a, e in engine.trace]  # fmt: skip
        (Path(run_dir) / f"trace-rank{rank}.json").write_text(json.dumps(events))
    stage_summary = engine.stage_summary()
    stage_summary.update(cut_control_wait_s=control.wait_s, cuts=control.cuts, checkpoint_save_s=save_s)
    stages = [None] * world
    tdist.all_gather_object(stages, stage_summary)
    stopped = status != "completed"
    code = {"completed": 0, "diverged": EXIT_DIVERGED, "interrupted": EXIT_INTERRUPTED}[status]
    if rank != 0:  # every rank exits with the run's code (under SLURM each is a task)
        return {"rank": rank, "stage_summary": stage_summary, "stopped_early": stopped, "status": status,
                "exit_code": code}  # fmt: skip
    done = history[-1]["step"] if history else start
    summary = {
        "status": status,
        "final_val_loss": final_val if math.isfinite(final_val) else None,
        "tokens": done * tokens_per_step,
        "steps": done,
        "wall_time": time.perf_counter() - started,
        "exit_code": code,
        "stages": stages,
    }
    if tracker is not None:
        tracker.finish(summary)
    return {**summary, "history": history, "stopped_early": stopped}


def run_rank(cfg: DictConfig, log: Callable[[str], None] = print) -> dict:
    """This process is one rank of an `engine=pipeline` job started by torchrun or SLURM: rank 0 prepares
    the run dir and writes the record, every rank trains its stage; returns rank 0's summary."""
    from asyncpipe.run import prepare_run_dir

    refuse_unsupported(cfg)
    rank, _, _ = rank_env()
    path = prepare_run_dir(cfg) if rank == 0 else Path(cfg.run.dir)
    every = max(1, cfg.train.log_every)

    def progress(m: dict) -> None:
        if m["step"] % every == 0 or m["step"] == cfg.train.steps or "val_loss" in m:
            log(_progress_line(m, cfg.train.steps))

    result = run_pipeline(cfg, path, on_step=progress if rank == 0 else None, log=log)
    return {k: v for k, v in result.items() if k != "history"}


def _progress_line(m: dict, steps: int) -> str:
    val = f" | val {m['val_loss']:.4f}" if "val_loss" in m else ""
    return f"step {m['step']}/{steps} | loss {m['train_loss']:.4f}{val} | {m['tokens_per_s']:.0f} tok/s"


def launch_local(
    cfg: DictConfig,
    overrides: Sequence[str] = (),
    log: Callable[[str], None] = print,
    on_step: Optional[StepCallback] = None,
    run_dir: Union[str, os.PathLike, None, bool] = True,
    timeout_s: Optional[float] = None,
) -> dict:
    """Train ``cfg`` (engine=pipeline) in P x D local processes; returns the run summary.

    ``run_dir=True`` prepares ``cfg.run.dir`` (config.yaml; rank 0 writes metrics.jsonl and summary.json),
    ``None``/``False`` writes nothing. The children get the resolved config, so ``overrides`` are not needed
    again. Progress prints through ``log`` unless ``on_step`` takes the per-step metrics.
    """
    refuse_unsupported(cfg)
    path: Optional[Path] = None
    if run_dir is True:
        from asyncpipe.run import prepare_run_dir

        path = prepare_run_dir(cfg)
    elif run_dir:
        path = Path(run_dir)
    every = max(1, cfg.train.log_every)
    p = cfg.pipeline
    log(
        f"pipeline: {p.stages} stages x {p.data_parallel} replicas, delay {cfg.delay} "
        f"({'2BW' if cfg.delay else '1F1B'}), {cfg.optimizer.name}, {cfg.train.steps} steps"
    )

    def relay(_: int, m: dict) -> None:
        if on_step is not None:
            on_step(m)
        elif m["step"] % every == 0 or m["step"] == cfg.train.steps or "val_loss" in m:
            log(_progress_line(m, cfg.train.steps))

    from asyncpipe.pipe.local import launch_many

    (result,) = launch_many([cfg], [path], on_step=relay, timeout_s=timeout_s)
    result = {k: v for k, v in result.items() if k != "history"}  # metrics.jsonl holds it
    if path is not None:
        log(f"{result.get('status')}: final val loss {result.get('final_val_loss')} | run dir {path}")
    return result
