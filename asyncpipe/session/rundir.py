"""The run dir as a trustworthy record: one writer at a time, never a sweep root, never overwritten, and resumed
only with the settings it was started with. Every refusal is a one-line `UserError` raised before anything in
the run dir changes (config.yaml included).

The writer lock (`track.lock.DirLock.writer`, ``RUN/.writer.lock``) is held by the process that writes the run
dir (the only process of a one-process run, the launcher of local ranks, rank 0 under torchrun/SLURM) for the
run's life; the kernel drops it when that process ends, however it ends, so a killed run can always be resumed.
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from asyncpipe.config.alias import resolve_switch
from asyncpipe.config.describe import schema_defaults
from asyncpipe.config.keys import flatten, frozen
from asyncpipe.errors import UserError
from asyncpipe.paths import run_dir_place
from asyncpipe.status import COMPLETED
from asyncpipe.track.files import (
    CONFIG_FILE,
    MAX_METRICS_FILE,
    METRICS_FILE,
    PROVENANCE_FILE,
    SUMMARY_FILE,
    RunDir,
    UnreadableFile,
    changes_no_result,
    atomic_write_bytes,
    load_untrusted_yaml,
    parse_metrics_lines,
    read_summary,
    read_untrusted,
)
from asyncpipe.track.lock import DirLock


def hold_writer_lock(run_dir: Path) -> DirLock:
    """Take the run dir's writer lock or refuse (one line): another process is training in this run dir."""
    lock = DirLock.writer(run_dir)
    if not lock.acquire():
        raise UserError(
            f"run dir {run_dir} is in use by another process training in it; wait for it to end "
            "(or stop it), or choose another run.dir"
        )
    return lock


def _check_place(path: Path) -> None:
    run_dir_place(path)  # not a sweep dir, not inside another run dir
    if path.exists() and not path.is_dir():
        raise UserError(f"run.dir={path} is a file, not a directory; choose another run.dir")


def changed_settings(recorded: dict, cfg: DictConfig) -> list[tuple[str, Any, Any]]:
    """(key, recorded value, new value) for every setting a resume may not change, in key order. A key the record
    lacks because the schema gained it after the run started is no change while it holds its default (the default
    is what the run ran before the key existed). A record's ``optimizer.ef.enabled=true`` is read as the
    ``compensation=ef`` it is now (`asyncpipe.config.alias`)."""
    old = flatten(resolve_switch(copy.deepcopy(recorded), strict=False))
    new = flatten(OmegaConf.to_container(cfg, resolve=True))
    defaults = schema_defaults()
    keys = sorted(set(old) | set(new))
    added = {k for k in keys if k not in old and k in defaults and frozen(new.get(k)) == defaults[k]}
    return [
        (k, old.get(k, defaults.get(k)), new.get(k))  # a key the record lacks: what the run ran with
        for k in keys
        if old.get(k) != new.get(k) and k not in added and not changes_no_result(k)
    ]


BRANCH_MAY_DIFFER = ("train.steps",)  # a budget branch is its parent's run at another length, nothing else


def check_branch(parent: Path, cfg: DictConfig) -> int:
    """`run.branch_from=parent`: the parent's recorded settings must equal this run's but for `train.steps` (and the
    keys that cannot change a result), or the branch would not be the run its settings describe. Returns the
    parent's `train.steps`."""
    path = Path(parent) / CONFIG_FILE
    try:
        recorded, _ = load_untrusted_yaml(read_untrusted(path), str(path))
    except FileNotFoundError:
        raise UserError(f"run.branch_from={parent} is not a run dir (no {CONFIG_FILE}); run the parent first") from None
    if not isinstance(recorded, dict):
        raise UserError(f"{path} is not a run config (a YAML mapping); run.branch_from needs the parent's run dir")
    diff = [d for d in changed_settings(recorded, cfg) if d[0] not in BRANCH_MAY_DIFFER]
    if diff:
        shown = ", ".join(f"{k}: {old!r} -> {new!r}" for k, old, new in diff[:4]) + (", ..." if len(diff) > 4 else "")
        raise UserError(
            f"run.branch_from={parent} ran other settings ({shown}); a branch differs from its parent "
            "only in train.steps"
        )
    steps = (recorded.get("train") or {}).get("steps") if isinstance(recorded.get("train"), dict) else None
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise UserError(
            f"{path}: train.steps is {steps!r}, not a positive integer; run.branch_from needs the parent's own record"
        )
    return steps


def branch_refusal(parent: Path, at: int, steps: int) -> str:
    """The one line for a branch with no checkpoint to start from exactly, and what works instead."""
    return (
        f"run.branch_from={parent} has no complete checkpoint at or before step {at} (the parent's decay start "
        f"or this run's, whichever is first: a later one holds decayed steps, not this run's); train the parent "
        f"again with checkpoint.branches=[{steps}] (move its run dir away first; a budget sweep does this when "
        f"re-run), or train this run alone without run.branch_from"
    )


MAX_SEED = 2**32 - 1  # numpy's generators take 0..2**32-1; torch's take less once the model mixes in a layer index


def check_seed(cfg: DictConfig) -> None:
    """A seed every generator of a run accepts: checked before the run dir exists, since a seed torch or numpy
    refuses would otherwise fail the run after its record is half-made (and that record refuse the fixed command)."""
    seed = cfg.get("seed")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        text = str(seed) if len(str(seed)) <= 24 else f"{str(seed)[:20]}... ({len(str(seed))} digits)"
        raise UserError(f"seed={text} must be an integer in [0, {MAX_SEED}] (2**32 - 1)")


STARTED_FILES = (SUMMARY_FILE, METRICS_FILE, PROVENANCE_FILE, "train.log")  # what a start writes beside config.yaml


def never_stepped(path: Path) -> bool:
    """True when the run recorded in `path` failed or stopped before finishing its first step: no checkpoint, and
    no metrics record past step 0 (nothing was trained, so the same command may start it afresh)."""
    if any((path / "checkpoints").glob("step_*")):
        return False
    try:
        records = parse_metrics_lines(read_untrusted(path / METRICS_FILE, MAX_METRICS_FILE), METRICS_FILE)
    except FileNotFoundError:
        return True
    except UnreadableFile:
        return False  # unsure: keep the record (the refusal names it)
    return all(isinstance(r.get("step"), int) and r["step"] <= 0 for r in records)


def fresh_start_over(cfg: DictConfig, summary: Optional[dict]) -> bool:
    """Whether `train` without resume=true may start afresh in a run dir that already holds a record: only one
    whose run never finished a step (a failure or a stop during set-up)."""
    return not cfg.resume and (summary or {}).get("status") != COMPLETED and never_stepped(Path(cfg.run.dir))


def check_run_dir(cfg: DictConfig) -> Path:
    """Refuse what the run dir cannot take: a sweep root, a dir inside another run or a file, a finished or started
    run without resume=true (unless it never finished a step: `fresh_start_over`), a completed run, a resume with
    changed settings, a seed no generator takes. Writes nothing."""
    check_seed(cfg)
    path = Path(cfg.run.dir)
    _check_place(path)
    summary = read_summary(path)  # a corrupt one is a UserError
    recorded = path / CONFIG_FILE
    if summary is not None and summary.get("status") == COMPLETED:
        if cfg.resume:
            raise UserError(f"run dir {path} holds a completed run; nothing to resume")
        raise UserError(f"run dir {path} already holds a run; choose another run.dir")
    if not cfg.resume and (summary is not None or recorded.exists()) and not fresh_start_over(cfg, summary):
        raise UserError(f"run dir {path} already holds a run; choose another run.dir or pass resume=true")
    if cfg.resume and recorded.exists():
        try:  # untrusted: a FIFO must not hang the resume, an alias bomb must not expand
            old, _ = load_untrusted_yaml(read_untrusted(recorded), str(recorded))
        except (OSError, UserError) as exc:
            raise UserError(f"{exc}; the run cannot be resumed (choose another run.dir)") from None
        if not isinstance(old, dict):
            raise UserError(f"{recorded} is not readable YAML; the run cannot be resumed (choose another run.dir)")
        diff = changed_settings(old, cfg)
        if diff:
            key, was, now = diff[0]
            more = f" (and {len(diff) - 1} more: {', '.join(k for k, _, _ in diff[1:4])})" if len(diff) > 1 else ""
            raise UserError(
                f"resume=true with a changed setting: {key} was {was!r} when the run started, now {now!r}{more}; "
                "resume with the recorded settings (see config.yaml) or start a new run.dir"
            )
    return path


class RunRecord:
    """The run dir of a run about to start: locked, checked, its config.yaml written (see `open`)."""

    def __init__(self, path: Path, lock: DirLock, created: bool) -> None:
        self.path, self.lock, self.created = path, lock, created
        self.previous: Optional[bytes] = b""  # config.yaml before this run wrote it (None: there was none)
        self.note: Optional[str] = None  # what the caller should say about this start (a start over)

    @classmethod
    def open(cls, cfg: DictConfig) -> "RunRecord":
        """Check the run dir (`check_run_dir`), lock it, check again and write the resolved config.yaml (a resume's
        differs from the recorded one only in keys that cannot change a result: `track.files.changes_no_result`); a refusal leaves no new directory or
        file behind and never rewrites config.yaml."""
        from asyncpipe.config import to_yaml

        path = Path(cfg.run.dir)
        check_run_dir(cfg)  # before the lock file exists: a refused run writes nothing
        created = not path.exists()
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UserError(f"cannot create run.dir={path}: {exc.strerror}") from None
        record = cls(path, DirLock.writer(path), created)  # not held yet: a refusal below removes nothing
        try:
            record.lock = hold_writer_lock(path)
            check_run_dir(cfg)  # again, as the writer: the run dir may have changed before we held the lock
            recorded = path / CONFIG_FILE
            record.previous = recorded.read_bytes() if recorded.exists() else None
            if record.previous is not None and fresh_start_over(cfg, read_summary(path)):
                for name in STARTED_FILES:  # the record of a start that trained nothing
                    (path / name).unlink(missing_ok=True)
                record.note = (
                    f"run dir {path} held a run that ended before its first step; nothing was trained, "
                    "so it starts afresh"
                )
            RunDir(path).write_config(to_yaml(cfg))  # a resume's: the same settings (checked), resume=true
        except BaseException:
            record.close(failed_by_user=True)
            raise
        return record

    def close(self, failed_by_user: bool = False) -> None:
        """Release the lock; after a user mistake in a directory this run created (and locked), remove it: it
        holds no run."""
        held = self.lock.fd is not None
        if failed_by_user and self.created and held:
            shutil.rmtree(self.path, ignore_errors=True)
        elif failed_by_user and held and self.previous is None:
            (self.path / CONFIG_FILE).unlink(missing_ok=True)
        elif failed_by_user and held and self.previous:  # a refused resume leaves the record as it was
            atomic_write_bytes(self.path / CONFIG_FILE, self.previous)
        self.lock.release()
