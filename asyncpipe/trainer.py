"""`Trainer`: the one owner of a run in this process. It builds, once and in this order, its set-up in one call
(`runtime.setup.build_setup`: the device, the process group, plus DeepSpeed's comm for engine=pipeline, the
prepared data: rank 0 prepares, the others wait), the engine (`runtime.protocol.Engine`:
`SimulatorEngine` or `PipelineEngineAdapter`) and the validation batches; `run` is the run's one loop: resume ->
steps -> evaluation cadence, divergence, checkpoints and the stop agreement -> summary, with rank 0's tracker
(metrics.jsonl, summary.json) and progress lines.

Every rank executes `run` in lockstep and takes the same decisions: stop requests and the train loss are agreed
through `Engine.agree`, which may answer one step late (the pipeline agrees at batch cuts without stalling its
stream: `engines.pipeline.faults.CutControl`). The launchers around it (`asyncpipe.run`, `asyncpipe.rank`) only
claim the run dir and start processes.
"""

from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path
from typing import Any, Callable, Optional

from omegaconf import DictConfig

from asyncpipe.errors import UserError
from asyncpipe.lr_schedule import LRSchedule
from asyncpipe.runtime import checkpoint, diverged
from asyncpipe.runtime.protocol import Engine, Log, Setup
from asyncpipe.runtime.signals import StopRequest
from asyncpipe.session.progress import Book, Progress
from asyncpipe.status import COMPLETED, DIVERGED, FAILED, INTERRUPTED, exit_code


def _silent(_: str) -> None:
    pass


def _build_engine(cfg: DictConfig, setup: Setup, run_dir: Optional[Path]) -> Engine:
    if cfg.engine == "pipeline" and cfg.pipeline.get("torch_schedule") is not None:
        from asyncpipe.engines.pipeline.torch_engine import TorchPipeliningEngine  # PyTorch's own schedules

        return TorchPipeliningEngine(cfg, setup)
    if cfg.engine == "pipeline":
        from asyncpipe.engines.pipeline.adapter import PipelineEngineAdapter

        return PipelineEngineAdapter(cfg, setup, run_dir)
    from asyncpipe.engines.simulator import SimulatorEngine

    return SimulatorEngine(cfg, setup)


class Trainer:
    """This process's share of the run ``cfg``, written to ``run_dir`` (None: a benchmark or a test; nothing is
    written or resumed). Built for one process, one rank under torchrun / SLURM, or one rank of the local
    launcher alike (the rank environment says which). ``engine`` and ``evaluate()`` serve direct use too."""

    def __init__(self, cfg: DictConfig, run_dir: Optional[Path] = None, log: Log = _silent) -> None:
        from asyncpipe.data import MicroBatches
        from asyncpipe.plan import budgeted
        from asyncpipe.runtime.setup import build_setup

        self.started = time.perf_counter()  # the run's wall time includes this set-up
        self.earlier_wall = 0.0  # seconds of the run's earlier segments (a resume adds them: summary.json's wall_time)
        cfg = budgeted(cfg)  # pipeline.memory_gib: the balanced cut within it, as blocks per stage every reader takes
        self.cfg, self.run_dir = cfg, run_dir
        self.setup = build_setup(cfg, log)  # rank, determinism, device, process group, prepared data: one call
        self.say = self.setup.log
        data_dir = self.setup.data_dir
        self.train_tokens = self.setup.train_tokens  # one epoch: a summary's `epochs` is tokens / this
        self.engine = _build_engine(cfg, self.setup, run_dir)
        # The validation set, built once: every run of a study is scored on the same tokens (data seed 0, not the
        # run's), each rank on its share (`Engine.val_share`).
        t = cfg.train
        val = MicroBatches(data_dir, "val", t.seq_len, t.micro_batch_size, 0)
        self.val_batches = [val.get(i) for i in self.engine.val_share(t.eval_batches)]

    def evaluate(self) -> float:
        """The val loss of the current weights (collective; meaningful on rank 0)."""
        return self.engine.evaluate(self.val_batches)

    # -- checkpoints ------------------------------------------------------------------------------------
    def resume(self, run_dir: Path) -> Optional[Path]:
        """resume=true: every rank loads its part of the newest complete checkpoint that reads on every rank (or
        none: step 0; `checkpoint.load_latest` says which it passed over). A refusal on any rank is a `UserError`
        on all of them, raised before anything in the run dir changes; then rank 0 drops the metrics logged after
        the checkpoint."""
        from asyncpipe.track import RunDir

        engine, cfg = self.engine, self.cfg
        path, state, error = None, None, None
        try:
            path, state = checkpoint.load_latest(
                run_dir,
                checkpoint.fingerprint_of(cfg),
                rank=engine.rank,
                world=engine.world,
                gather=engine.comm.gather,
                log=self.say,
            )
        except UserError as err:
            error = str(err)
        first = next((e for e in engine.comm.gather(error) if e), None)
        if first is not None:
            raise UserError(first)
        if state is None:
            where = "the parent's checkpoint (run.branch_from)" if cfg.run.branch_from is not None else "step 0"
            self.say(f"resume=true but no complete checkpoint: starting from {where}")
        else:
            engine.load_state_dict(state)
            self.say(f"resumed from {path} at step {engine.step}")
        if engine.rank == 0:
            self.earlier_wall = earlier_wall_time(run_dir)
            RunDir(run_dir).truncate_metrics(after_step=engine.step if state is not None else -1)
        return path

    def save(self, run_dir: Path) -> Path:
        """Every rank writes its part of a checkpoint of this step; rank 0 marks it complete."""
        engine = self.engine
        return checkpoint.save(
            run_dir,
            engine.step,
            engine.state_dict(),
            checkpoint.fingerprint_of(self.cfg),
            rank=engine.rank,
            world=engine.world,
            barrier=engine.comm.barrier,
            keep=self.cfg.checkpoint.keep,
            pinned=self.branch_points(),
        )

    # -- budget branches (wsd): shorter runs start from a longer run's stable phase --------------------
    def branch_points(self) -> set[int]:
        """The steps `checkpoint.branches` asks to keep: the decay starts of those shorter runs."""
        branches = list(self.cfg.checkpoint.branches)
        schedule = LRSchedule.of(self.cfg.train) if branches else None
        return {schedule.at_steps(int(n)).decay_start for n in branches} if schedule is not None else set()

    def branch(self, parent: Path) -> Path:
        """`run.branch_from`: every rank loads its part of the parent's newest complete checkpoint at or before this
        run's decay start (up to there a longer wsd run with these settings is this run, bit for bit); rank 0
        starts this run's metrics with the parent's up to that step and records the branch (branch.json). A
        problem on any rank is a `UserError` on all of them, raised before anything is written."""
        from asyncpipe.session.rundir import branch_refusal, check_branch
        from asyncpipe.track import RunDir, atomic_write_json
        from asyncpipe.track.files import BRANCH_RECORD

        engine, cfg = self.engine, self.cfg
        at, path, state, error, parent_steps = LRSchedule.of(cfg.train).decay_start, None, None, None, None
        try:
            # Exact only up to both decay starts: the parent's steps after its own are decayed, not this run's.
            parent_steps = check_branch(parent, cfg)
            at = min(at, LRSchedule.of(cfg.train).at_steps(parent_steps).decay_start)
            path = checkpoint.latest_complete(parent, world=engine.world, log=self.say, at_most=at)
            if path is None:
                raise UserError(branch_refusal(parent, at, cfg.train.steps))
            state = checkpoint.load(path, checkpoint.fingerprint_of(cfg), rank=engine.rank, ignore=("steps",))
        except UserError as err:
            error = str(err)
        first = next((e for e in engine.comm.gather(error) if e), None)
        if first is not None:
            raise UserError(first)
        engine.load_state_dict(state)
        self.say(f"branched from {path} at step {engine.step} (this run's decay starts at step {at})")
        if engine.rank == 0 and self.run_dir is not None:
            RunDir(self.run_dir).truncate_metrics(engine.step, records=RunDir(parent).read_metrics())
            atomic_write_json(
                Path(self.run_dir) / BRANCH_RECORD,
                {"parent": str(parent), "step": engine.step, "checkpoint": str(path), "parent_steps": parent_steps},
            )
        return path

    def branch_summary(self) -> dict:
        """`branch_of` (the parent run dir) and `branch_step` for a branch's summary, from its branch.json (none: not
        a branch, whatever run.branch_from says)."""
        from asyncpipe.track.files import BRANCH_RECORD, read_json_object

        if self.cfg.run.branch_from is None or self.run_dir is None:
            return {}
        try:
            record = read_json_object(Path(self.run_dir) / BRANCH_RECORD)
        except (OSError, UserError):
            return {}
        return {
            "branch_of": record.get("parent"),
            "branch_step": record.get("step"),
            "branch_parent_steps": record.get("parent_steps"),
        }

    # -- the run ----------------------------------------------------------------------------------------
    def run(
        self,
        stop: Optional[StopRequest] = None,
        on_step: Optional[Callable[[dict], None]] = None,
        show_progress: bool = True,
    ) -> dict:
        """Train to ``train.steps`` and return the summary (on every rank; rank 0 also writes it and returns the
        step ``history``). ``stop``: the caller's `StopRequest`, already entered (installed early, so a signal
        during set-up still ends in a summary); else one is installed here. ``show_progress``: rank 0 prints the
        description and progress lines."""
        from asyncpipe.track import Tracker

        cfg, engine, run_dir = self.cfg, self.engine, self.run_dir
        t, rank = cfg.train, engine.rank
        self.start_segment()
        start = engine.step
        tracker = Tracker(cfg, run_dir, rank=rank, say=self.say) if run_dir is not None and rank == 0 else None
        progress = Progress(t.steps, start, t.log_every, engine.describe()) if rank == 0 and show_progress else None
        book = Book(tracker, engine.tokens_per_step, t.diverge_loss, progress, on_step, vocab=self.setup.vocab_size)
        status, final_val, save_s = FAILED, math.nan, []
        installed = contextlib.nullcontext(stop) if stop is not None else StopRequest()
        try:
            with installed as stop:
                status, final_val = self.step_loop(stop, book, start, save_s)
                status, extra = self.finish_engine(status, book)
        except BaseException:
            if tracker is not None:
                with contextlib.suppress(OSError):  # a full disk must not hide the error that ended the run
                    tracker.finish(
                        {"status": FAILED, "wall_time": self.earlier_wall + time.perf_counter() - self.started}
                    )
            raise
        finally:
            if progress is not None:
                progress.close()
        summary = self.summary(status, final_val, book, start, save_s, extra)
        if tracker is not None:
            tracker.finish(summary)
        if rank == 0 and run_dir is not None:
            self.say(f"{status}: final val loss {summary['final_val_loss']} | run dir {run_dir}")
        return {**summary, "history": book.history} if rank == 0 else {**summary, "rank": rank}

    def start_segment(self) -> None:
        """Resume from the run dir (resume=true) or branch from a parent's checkpoint (run.branch_from)."""
        if self.cfg.resume:
            if self.run_dir is None:
                raise UserError("resume=true needs a run dir to resume from (run.dir)")
            self.resume(self.run_dir)
        if self.engine.step == 0 and self.cfg.run.branch_from is not None:
            self.branch(Path(self.cfg.run.branch_from))

    def step_loop(self, stop: StopRequest, book: Book, start: int, save_s: list) -> tuple[str, float]:
        """The step loop, from ``start`` to ``train.steps``: (status, last val loss). Stops early on divergence or
        a stop signal (saving a checkpoint to resume from); appends each checkpoint's save time to ``save_s``."""
        cfg, engine, run_dir, say = self.cfg, self.engine, self.run_dir, self.say
        t, every, pins = cfg.train, cfg.checkpoint.every, self.branch_points()
        final_val = math.nan
        if start == 0:
            final_val = self.evaluate()
            book.val_at[0] = final_val
            book.log({"step": 0, "tokens": 0, "val_loss": final_val})
        if engine.comm.any(stop.requested):  # a signal during set-up: no step runs, nothing new to save
            say(
                f"{stop.signal_name or 'stop'} before the first step"
                + (f"; resume=true continues from step {start}" if run_dir is not None else "")
            )
            return INTERRUPTED, final_val
        for step in range(start + 1, t.steps + 1):
            last = step == t.steps
            eval_now = step % t.eval_every == 0 or last
            save_now = (bool(every) and step % every == 0 or step in pins) and not last and run_dir is not None
            engine.train_step(sync=eval_now or save_now, save=save_now)
            seen = engine.agree(stop.requested)
            blown = seen.loss is not None and diverged(seen.loss, t.diverge_loss)
            halt = blown or (seen.stop and not last)  # a stop during the last step lets the run complete
            if halt:
                engine.settle()
            if eval_now and not blown:
                final_val = book.val_at[step] = self.evaluate()
            book.emit(engine.records(synced=eval_now or save_now or halt))
            if blown:
                say(f"diverged at step {seen.loss_step}: train loss {seen.loss}")
                return DIVERGED, final_val
            if (halt or save_now) and run_dir is not None:
                began = time.perf_counter()
                path = self.save(run_dir)
                save_s.append(time.perf_counter() - began)
            if halt:
                where = (
                    f"checkpoint {path} written; resume=true continues"
                    if run_dir is not None
                    else f"stopped after step {step} (no run dir: nothing to resume)"
                )  # a bench's job
                say(f"{stop.signal_name or 'stop'}: {where}")
                return INTERRUPTED, final_val
        return COMPLETED, final_val

    def finish_engine(self, status: str, book: Book) -> tuple[str, dict]:
        """Drain the engine's last in-flight work and judge it: (status, the engine's extra summary fields)."""
        tail, extra = self.engine.finish()
        if status == COMPLETED and tail.loss is not None and diverged(tail.loss, self.cfg.train.diverge_loss):
            status = DIVERGED
            self.say(f"diverged at step {tail.loss_step}: train loss {tail.loss}")
        book.emit(self.engine.records(synced=True))
        if status == COMPLETED and book.collapsed:  # not a result: never averaged into a report
            status, extra = DIVERGED, {**extra, "collapsed": book.collapsed}
            self.say(f"diverged: {book.collapsed}")
        return status, extra

    def summary(self, status: str, final_val: float, book: Book, start: int, save_s: list, extra: dict) -> dict:
        """The run's summary.json fields for this segment."""
        engine = self.engine
        done = book.history[-1]["step"] if book.history else start
        segment = time.perf_counter() - self.started
        return {
            "status": status,
            "final_val_loss": final_val if final_val is not None and math.isfinite(final_val) else None,
            "tokens": done * engine.tokens_per_step,
            "steps": done,
            "wall_time": self.earlier_wall + segment,  # every segment of the run
            **({"wall_time_this_segment": segment} if self.earlier_wall else {}),
            "exit_code": exit_code(status),
            "epochs": done
            * engine.tokens_per_step
            / self.train_tokens,  # passes over the train split (> 1: data repeated)
            **(self.branch_summary() if engine.rank == 0 else {}),
            **({"checkpoint_save_s": save_s} if save_s else {}),
            **extra,
        }


def earlier_wall_time(run_dir: Path) -> float:
    """The wall time the run's earlier segments recorded (summary.json, written when a segment ends), 0 without one;
    a segment killed before writing its summary is not counted."""
    from asyncpipe.track.files import read_summary

    try:
        value = (read_summary(run_dir) or {}).get("wall_time")
    except UserError:
        return 0.0
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) and value > 0 else 0.0


def train(
    cfg: DictConfig,
    run_dir: Optional[Path],
    log: Log = print,
    stop: Optional[StopRequest] = None,
    on_step: Optional[Callable[[dict], None]] = None,
    show_progress: bool = True,
) -> dict:
    """Build this process's `Trainer` and run it: what every process layout calls (`asyncpipe.run`,
    `asyncpipe.rank`). Set-up errors (bad data, a foreign checkpoint) surface before any step is logged."""
    return Trainer(cfg, run_dir, log).run(stop=stop, on_step=on_step, show_progress=show_progress)
