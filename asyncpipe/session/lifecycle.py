"""The one run lifecycle, whatever the engine: resume -> step loop -> evaluation, divergence, checkpoints and the
stop agreement -> summary. Written once; an engine only says how one step is computed (`Engine`).

Every rank of a run executes `run` in lockstep and takes the same decisions: stop requests and the train loss
are agreed through `Engine.agree`, which may answer one step late (the pipeline agrees at batch cuts without
stalling its stream: `asyncpipe.pipe.faults.CutControl`). Rank 0 writes metrics.jsonl and summary.json.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Protocol

from omegaconf import DictConfig

from asyncpipe.errors import UserError
from asyncpipe.runtime import checkpoint, diverged
from asyncpipe.runtime.signals import StopRequest
from asyncpipe.session.progress import Progress
from asyncpipe.status import COMPLETED, DIVERGED, FAILED, INTERRUPTED, exit_code

Log = Callable[[str], None]


@dataclass
class Agreement:
    """What every rank knows at a step: a stop was asked for on some rank, and the agreed train loss of step
    ``loss_step`` (None: no loss known yet)."""

    stop: bool = False
    loss: Optional[float] = None
    loss_step: int = 0


class Engine(Protocol):
    """How one step is computed. `asyncpipe.engines.simulator.SimulatorEngine` (engine=simulate) and
    `asyncpipe.pipe.adapter.PipelineEngineAdapter` (engine=pipeline) implement it."""

    rank: int
    world: int
    step: int  # optimizer steps done
    tokens_per_step: int
    comm: Any  # `asyncpipe.dist.Comm`: barrier / gather over the engine's control group

    def describe(self) -> str: ...  # the run's one-line description, printed first

    def train_step(self, sync: bool) -> Any: ...  # one optimizer step; ``sync``: its update lands now

    def agree(self, stop: bool) -> Agreement: ...  # collective, once per step

    def settle(self) -> None: ...  # apply what is pending, before a checkpoint or leaving early

    def records(self, synced: bool) -> list[dict]: ...  # rank 0: metrics of the steps finished so far

    def evaluate(self) -> float: ...  # collective; the val loss (meaningful on rank 0)

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...

    def finish(self) -> tuple[Agreement, dict]: ...  # collective: the last agreement, extra summary fields


def resume(engine: Engine, cfg: DictConfig, run_dir: Path, log: Log) -> Optional[Path]:
    """resume=true: every rank loads its part of the latest complete checkpoint (or none: step 0). A bad part on
    any rank is a `UserError` on all of them, raised before anything in the run dir changes; then rank 0 drops
    the metrics logged after the checkpoint."""
    from asyncpipe.track import RunDir

    path, state, error = None, None, None
    try:
        path = checkpoint.latest_complete(run_dir, world=engine.world, log=log)
        if path is not None:
            state = checkpoint.load(path, checkpoint.fingerprint_of(cfg), rank=engine.rank)
    except UserError as err:
        error = str(err)
    first = next((e for e in engine.comm.gather(error) if e), None)
    if first is not None:
        raise UserError(first)
    if state is None:
        log("resume=true but no complete checkpoint: starting from step 0")
    else:
        engine.load_state_dict(state)
        log(f"resumed from {path} at step {engine.step}")
    if engine.rank == 0:
        RunDir(run_dir).truncate_metrics(after_step=engine.step if state is not None else -1)
    return path


def save(engine: Engine, cfg: DictConfig, run_dir: Path) -> Path:
    """Every rank writes its part of a checkpoint of this step; rank 0 marks it complete."""
    return checkpoint.save(
        run_dir, engine.step, engine.state_dict(), checkpoint.fingerprint_of(cfg), rank=engine.rank,
        world=engine.world, barrier=engine.comm.barrier, keep=cfg.checkpoint.keep,
    )  # fmt: skip


class Book:
    """Rank 0's record of the steps: val losses joined to their step, tokens, the stop at the first diverged
    step, metrics.jsonl (through the tracker), progress lines and ``on_step``."""

    def __init__(self, tracker: Any, tokens_per_step: int, limit: float, progress: Optional[Progress],
                 on_step: Optional[Callable[[dict], None]]) -> None:  # fmt: skip
        self.tracker, self.tokens_per_step, self.limit = tracker, tokens_per_step, limit
        self.progress, self.on_step = progress, on_step
        self.val_at: dict[int, float] = {}
        self.history: list[dict] = []
        self.diverged = False

    def log(self, record: dict) -> None:
        if self.tracker is not None:
            self.tracker.log(record)

    def emit(self, records: list[dict]) -> None:
        for rec in records:
            if self.diverged:
                break  # the record ends at the first diverged step
            step = int(rec["step"])
            out = {"step": step, "tokens": step * self.tokens_per_step}
            out.update((k, v) for k, v in rec.items() if k != "step")
            out["tokens_per_s"] = self.tokens_per_step / max(rec["step_time"], 1e-9)
            if step in self.val_at:
                out["val_loss"] = self.val_at[step]
            self.diverged = diverged(rec["train_loss"], self.limit)
            self.history.append(out)
            self.log(out)
            if self.progress is not None:
                self.progress.update(step, out)
            if self.on_step is not None:
                self.on_step(out)


def run(
    engine: Engine,
    cfg: DictConfig,
    run_dir: Optional[Path],
    log: Log = print,
    stop: Optional[StopRequest] = None,
    on_step: Optional[Callable[[dict], None]] = None,
    started: Optional[float] = None,
    show_progress: bool = True,
) -> dict:
    """Train ``engine`` to ``train.steps`` and return the summary (on every rank; rank 0 also writes it and
    returns the step ``history``). ``run_dir`` None (a benchmark): nothing is written and nothing resumed.
    ``stop``: the caller's `StopRequest`, already entered (installed early, so a signal during set-up still ends
    in a summary); else one is installed here. ``show_progress``: rank 0 prints the description and progress."""
    from asyncpipe.track import Tracker

    started = time.perf_counter() if started is None else started
    t, rank = cfg.train, engine.rank
    say = log if rank == 0 else (lambda _: None)
    if cfg.resume:
        if run_dir is None:
            raise UserError("resume=true needs a run dir to resume from (run.dir)")
        resume(engine, cfg, run_dir, say)
    start = engine.step
    tracker = Tracker(cfg, run_dir, rank=rank) if run_dir is not None and rank == 0 else None
    status, final_val = FAILED, math.nan
    progress = Progress(t.steps, start, t.log_every, engine.describe()) if rank == 0 and show_progress else None
    book = Book(tracker, engine.tokens_per_step, t.diverge_loss, progress, on_step)
    every, save_s = cfg.checkpoint.every, []
    installed = contextlib.nullcontext(stop) if stop is not None else StopRequest()
    try:
        with installed as stop:
            if start == 0:
                final_val = engine.evaluate()
                book.val_at[0] = final_val
                book.log({"step": 0, "tokens": 0, "val_loss": final_val})
            status = COMPLETED
            if engine.comm.any(stop.requested):  # a signal during set-up: no step runs, nothing new to save
                status = INTERRUPTED
                say(f"{stop.signal_name or 'stop'} before the first step; resume=true continues from step {start}")
            for step in range(start + 1, t.steps + 1) if status == COMPLETED else ():
                last = step == t.steps
                eval_now = step % t.eval_every == 0 or last
                save_now = bool(every) and step % every == 0 and not last and run_dir is not None
                engine.train_step(sync=eval_now or save_now)
                seen = engine.agree(stop.requested)
                blown = seen.loss is not None and diverged(seen.loss, t.diverge_loss)
                halt = blown or (seen.stop and not last)  # a stop during the last step lets the run complete
                if halt:
                    engine.settle()
                if eval_now and not blown:
                    final_val = book.val_at[step] = engine.evaluate()
                book.emit(engine.records(synced=eval_now or save_now or halt))
                if blown:
                    status = DIVERGED
                    say(f"diverged at step {seen.loss_step}: train loss {seen.loss}")
                    break
                if (halt or save_now) and run_dir is not None:
                    began = time.perf_counter()
                    path = save(engine, cfg, run_dir)
                    save_s.append(time.perf_counter() - began)
                if halt:
                    status = INTERRUPTED
                    where = f"checkpoint {path} written" if run_dir is not None else "no run dir to checkpoint"
                    say(f"{stop.signal_name or 'stop'}: {where}; resume=true continues")
                    break
            tail, extra = engine.finish()
            if status == COMPLETED and tail.loss is not None and diverged(tail.loss, t.diverge_loss):
                status = DIVERGED
                say(f"diverged at step {tail.loss_step}: train loss {tail.loss}")
            book.emit(engine.records(synced=True))
    except BaseException:
        if tracker is not None:
            tracker.finish({"status": FAILED, "wall_time": time.perf_counter() - started})
        raise
    finally:
        if progress is not None:
            progress.close()
    done = book.history[-1]["step"] if book.history else start
    summary = {
        "status": status,
        "final_val_loss": final_val if final_val is not None and math.isfinite(final_val) else None,
        "tokens": done * engine.tokens_per_step,
        "steps": done,
        "wall_time": time.perf_counter() - started,
        "exit_code": exit_code(status),
        **({"checkpoint_save_s": save_s} if save_s else {}),
        **extra,
    }
    if tracker is not None:
        tracker.finish(summary)
    if rank == 0 and run_dir is not None:
        say(f"{status}: final val loss {summary['final_val_loss']} | run dir {run_dir}")
    return {**summary, "history": book.history} if rank == 0 else {**summary, "rank": rank}
