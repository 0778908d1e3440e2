"""Sweep state on disk: the manifest `sweep.json`, each run dir's sweep lock (`track.lock.DirLock.sweep`), and
each run's state.

A run's state is read from its run dir alone (plus SLURM's view of its job, when it has one), so `sweep status`,
a second sweep into the same directory and a re-run of the sweep all agree on what is done.
"""

from __future__ import annotations

import json
import math
import os
import stat
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Optional

from asyncpipe.errors import UserError
from asyncpipe.sweep.expand import SweepPlan
from asyncpipe.status import COMPLETED, DIVERGED, FAILED, INTERRUPTED, PENDING, QUEUED, RUNNING
from asyncpipe.track.files import (
    BRANCH_RECORD,
    LAUNCH_RECORD,
    RETIRED,
    SWEEP_MANIFEST,
    atomic_write_json,
    read_json_object,
)
from asyncpipe.track.lock import DirLock

SLURM_RECORD = "slurm_job.json"

# Never re-run automatically (failed/diverged: --retry-failed), except a failure that lost a rank with its node.
FINAL = (COMPLETED, DIVERGED, FAILED)

# SLURM job states that mean "not finished yet" (squeue/sacct names).
SLURM_PENDING = frozenset(
    {"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "CONFIGURING", "RESV_DEL_HOLD", "SUSPENDED"}
)
SLURM_RUNNING = frozenset({"RUNNING", "COMPLETING", "SIGNALING", "STAGE_OUT", "RESIZING", "STOPPED"})
SLURM_ACTIVE = SLURM_PENDING | SLURM_RUNNING


def read_json(path: Path) -> Optional[dict]:
    """A JSON object from a run dir, or None when missing or unreadable (never a hang: see read_untrusted)."""
    try:
        return read_json_object(path)
    except (OSError, UserError):
        return None


@dataclass
class RunState:
    name: str
    state: str
    step: Optional[int] = None  # last step in metrics.jsonl
    steps: Optional[int] = None  # steps in the summary (finished runs)
    final_val_loss: Optional[float] = None
    val_loss: Optional[float] = None  # latest val loss in metrics.jsonl
    val_step: Optional[int] = None  # the step it was measured at
    job_id: Optional[str] = None
    slurm_state: Optional[str] = None
    note: str = ""
    branch_of: Optional[str] = None  # budgets: the run this one branches from, and the step (`parent @ step`)


def _tail_records(run_dir: Path, span: int = 65536) -> list[dict]:
    """The complete metrics.jsonl records in the file's last `span` bytes (a regular file only), oldest first."""
    path = run_dir / "metrics.jsonl"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return []
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # a FIFO or device in its place: nothing to show, never a hang
            return []
        os.lseek(fd, max(0, st.st_size - span), os.SEEK_SET)
        tail = os.read(fd, span).decode("utf-8", "replace")
    except OSError:
        return []
    finally:
        os.close(fd)
    out = []
    for line in tail.splitlines()[1 if st.st_size > span else 0 :]:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def _int(value: Any) -> Optional[int]:
    return (
        int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) else None
    )


def _progress(run_dir: Path, state: "RunState") -> None:
    """The last step, and the latest val loss with the step it was measured at, from metrics.jsonl's tail."""
    for rec in reversed(_tail_records(run_dir)):
        step = _int(rec.get("step"))
        if step is None:
            continue
        if state.step is None:
            state.step = step
        val = rec.get("val_loss")
        if isinstance(val, (int, float)) and not isinstance(val, bool) and math.isfinite(val):
            state.val_loss, state.val_step = float(val), step
            return


def _planned_steps(run_dir: Path) -> Optional[int]:
    """train.steps from the run's config.yaml (None when unreadable)."""
    from asyncpipe.track.files import load_untrusted_yaml, read_untrusted

    try:
        cfg, _ = load_untrusted_yaml(read_untrusted(run_dir / "config.yaml"), str(run_dir / "config.yaml"))
    except (OSError, UserError):
        return None
    train = cfg.get("train") if isinstance(cfg, dict) else None
    return _int(train.get("steps")) if isinstance(train, dict) else None


def file_state(run_dir: Path, locked: Optional[bool] = None) -> str:
    """The state the run dir shows by itself: final status, running (lock held), interrupted or pending.

    `locked`: whether another process holds the run's lock, when the caller already knows (it holds it itself).
    """
    summary = read_json(run_dir / "summary.json") or {}
    if summary.get("status") in FINAL:
        return str(summary["status"])
    if DirLock.sweep(run_dir).held_elsewhere() if locked is None else locked:
        return RUNNING
    launch = read_json(run_dir / LAUNCH_RECORD) or {}
    if launch.get("status") == FAILED:
        return FAILED
    started = any((run_dir / f).exists() for f in ("config.yaml", "metrics.jsonl", LAUNCH_RECORD, SLURM_RECORD))
    return INTERRUPTED if started else PENDING


def branch_label(run_dir: Path, parent: Optional[str]) -> Optional[str]:
    """`parent @ step` for a budget branch (the step from its branch.json once it has branched), else None."""
    if not parent:
        return None
    step = (read_json(run_dir / BRANCH_RECORD) or {}).get("step")
    return f"{parent} @ {step}" if _int(step) is not None else parent


def run_state(
    run_dir: Path, name: str, slurm_states: Optional[dict[str, str]] = None, parent: Optional[str] = None
) -> RunState:
    """Everything `sweep status` shows for one run; `slurm_states` maps job id -> SLURM state; `parent`: the run a
    budget branch starts from (the sweep's manifest says)."""
    state = RunState(name=name, state=file_state(run_dir), branch_of=branch_label(run_dir, parent))
    summary = read_json(run_dir / "summary.json") or {}
    final = summary.get("final_val_loss")
    state.final_val_loss = float(final) if _int(final) is not None else None
    state.steps = _int(summary.get("steps"))
    _progress(run_dir, state)
    if state.state not in FINAL:  # a running or interrupted run: its latest val loss, never the summary's older one
        state.final_val_loss = None
        state.steps = _planned_steps(run_dir) if state.step is not None else None
    record = read_json(run_dir / SLURM_RECORD)
    if record:
        state.job_id = str(record.get("job_id"))
        state.slurm_state = (slurm_states or {}).get(state.job_id)
        if state.state in (PENDING, INTERRUPTED) and state.slurm_state:
            if state.slurm_state in SLURM_PENDING:
                state.state = QUEUED
            elif state.slurm_state in SLURM_RUNNING:
                state.state = RUNNING
    if state.state == FAILED:
        launch = read_json(run_dir / LAUNCH_RECORD) or {}
        if launch.get("note"):
            state.note = str(launch["note"]) + ("; a re-run resumes it" if resumable_failure(run_dir) else "")
        elif not summary:
            state.note = f"exit code {launch.get('exit_code')}, see launch.log"
    return state


@dataclass
class Claim:
    """What a launcher may do with one run: `lock` is held (and must be released) when `start` is true."""

    start: bool
    resume: bool
    state: str
    note: str
    lock: Optional[DirLock] = None


def claim(run_dir: Path, retry_failed: bool, active_job: Optional[str] = None) -> Claim:
    """Lock the run and decide: start it fresh, resume it, or skip it (done, or running elsewhere).

    `active_job`: a SLURM job id already queued or running for this run (then it is skipped, not resubmitted).
    """
    lock = DirLock.sweep(run_dir)
    if not lock.acquire():
        return Claim(False, False, RUNNING, "running in another sweep (its lock is held)")
    state = file_state(run_dir, locked=False)
    if active_job is not None:
        lock.release()
        return Claim(False, False, QUEUED, f"already queued or running as SLURM job {active_job}")
    lost = resumable_failure(run_dir) if state == FAILED else None
    if lost is not None:  # lost a rank with its node: resume from the last complete checkpoint
        os.replace(run_dir / LAUNCH_RECORD, run_dir / f"launch.failed-{datetime.now():%Y%m%d-%H%M%S}.json")
        resume = (run_dir / "config.yaml").exists()
        return Claim(True, resume, state, f"resuming after a failure ({lost.get('note')})", lock)
    if state == COMPLETED or (state in FINAL and not retry_failed):
        lock.release()
        note = "already completed" if state == COMPLETED else "final state (re-run with --retry-failed)"
        return Claim(False, False, state, note)
    note = ""
    if state in FINAL:  # --retry-failed: keep the old attempt, start over in a clean dir
        old = retire(run_dir)
        fresh = DirLock.sweep(run_dir)
        got = fresh.acquire()
        lock.release()
        if not got:
            return Claim(False, False, RUNNING, "running in another sweep (its lock is held)")
        lock, note = fresh, f"retrying; old attempt in {old.parent.name}/{old.name}"
    resume = (run_dir / "config.yaml").exists()
    return Claim(True, resume, state, note or ("resuming" if resume else ""), lock)


def write_launch_record(run_dir: Path, exit_code: Optional[int], status: str, **details: Any) -> None:
    """`launch.json`; `details` may name the failed ranks (`note`) and mark the failure `resumable` (a rank was
    lost with its node: a re-run of the sweep resumes the run instead of leaving it failed)."""
    record = {"exit_code": exit_code, "status": status, "ended": datetime.now().isoformat(), **details}
    atomic_write_json(run_dir / LAUNCH_RECORD, record)


def resumable_failure(run_dir: Path) -> Optional[dict]:
    """The launch record of a failed run that lost a rank (and so may resume), else None."""
    launch = read_json(run_dir / LAUNCH_RECORD) or {}
    summary = read_json(run_dir / "summary.json") or {}
    if launch.get("status") == FAILED and launch.get("resumable") and summary.get("status") in (None, FAILED):
        return launch
    return None


def retire(run_dir: Path) -> Path:
    """Move a failed/diverged attempt out of the way (into the sweep's `.retired/`) so it restarts from scratch."""
    target_root = run_dir.parent / RETIRED
    target_root.mkdir(exist_ok=True)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    target = target_root / f"{run_dir.name}.{stamp}"
    n = 1
    while target.exists():
        n += 1
        target = target_root / f"{run_dir.name}.{stamp}-{n}"
    os.replace(run_dir, target)
    return target


# --- the manifest ---------------------------------------------------------------------------------------


def manifest_dict(plan: SweepPlan, created: Optional[str] = None) -> dict:
    return {
        "name": plan.name,
        "created": created or datetime.now().isoformat(timespec="seconds"),
        "base_overrides": list(plan.base),
        "grid": {k: list(v) for k, v in plan.grid.items()},
        "variants": {k: list(v) for k, v in plan.variants.items()},
        "per": plan.per,
        "launcher_overrides": list(plan.launcher),
        **({"budgets": list(plan.budgets)} if plan.budgets else {}),
        **({"variant_budgets": dict(plan.variant_budgets)} if plan.variant_budgets else {}),
        "runs": [
            {
                "name": r.name,
                "dir": r.name,
                "swept": list(r.swept),
                "overrides": list(r.overrides),
                "variant": r.variant,
                **({"budget": r.budget, "parent": r.parent} if r.budget is not None else {}),
            }
            for r in plan.runs
        ],
    }


def _merge_values(old: dict, new: dict) -> dict:
    """Per key, the old values then the new ones not among them."""
    out = {k: list(v) for k, v in old.items()}
    for k, values in new.items():
        out[k] = list(dict.fromkeys([*out.get(k, []), *values]))
    return out


def merged_manifest(sweep_dir: Path, plan: SweepPlan) -> dict:
    """The `sweep.json` a launch of `plan` into `sweep_dir` would write: new, or the existing one extended. A second
    launch of a sweep may add runs (more seeds, values or variants: existing runs are kept as they are) but never
    change its fixed overrides, its grid keys or the overrides of a run it already has. Writes nothing (a dry-run
    refuses exactly what the launch refuses)."""
    path = sweep_dir / SWEEP_MANIFEST
    old = load_sweep_manifest(sweep_dir) if os.path.lexists(path) else None
    new = manifest_dict(plan)
    if old is not None:
        what = f"{sweep_dir} already holds sweep '{old.get('name')}'"
        hint = "give another --name (or --out) for a different study; an existing sweep can only gain runs"
        if sorted(old.get("base_overrides", [])) != sorted(new["base_overrides"]):
            raise UserError(
                f"{what} with other fixed overrides ({' '.join(old.get('base_overrides', [])) or 'none'}); {hint}"
            )
        if list(old.get("grid", {})) != list(new["grid"]):
            raise UserError(f"{what} with grid keys {', '.join(old.get('grid', {})) or 'none'}; {hint}")
        before = {r["name"]: r for r in old.get("runs", [])}
        for run in new["runs"]:
            prev = before.get(run["name"])
            if prev is not None and prev.get("overrides") != run["overrides"]:
                raise UserError(f"{what}, whose run {run['name']} has other overrides; {hint}")
        added = [r for r in new["runs"] if r["name"] not in before]
        new.update(
            created=old.get("created", new["created"]),
            grid=_merge_values(old.get("grid", {}), new["grid"]),
            variants={**old.get("variants", {}), **new["variants"]},
            per={k: {**old.get("per", {}).get(k, {}), **v} for k, v in {**old.get("per", {}), **new["per"]}.items()},
            runs=old.get("runs", []) + added,
        )
        if old.get("budgets") or new.get("budgets"):
            new["budgets"] = sorted(set(old.get("budgets") or []) | set(new.get("budgets") or []))
    return new


def write_manifest(sweep_dir: Path, plan: SweepPlan, **extra: Any) -> dict:
    """Write (or check and extend) `sweep.json` (see `merged_manifest`); `extra`: more top-level entries (a budget
    sweep's cost against separate runs)."""
    new = {**merged_manifest(sweep_dir, plan), **extra}
    sweep_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(sweep_dir / SWEEP_MANIFEST, new)
    return new


def _manifest_problem(data: dict) -> Optional[str]:
    """What makes a loaded sweep.json unusable (wrong types, a run dir outside the sweep), or None."""
    for key, kind in (
        ("name", str),
        ("base_overrides", list),
        ("grid", dict),
        ("variants", dict),
        ("per", dict),
        ("launcher_overrides", list),
        ("runs", list),
    ):
        if key in data and data[key] is not None and not isinstance(data[key], kind):
            return f"{key} is a {type(data[key]).__name__}, not a {kind.__name__}"
    if any(not isinstance(v, list) for v in (data.get("grid") or {}).values()):
        return "a grid entry is not a list of values"
    for i, run in enumerate(data.get("runs") or []):
        if not isinstance(run, dict) or not isinstance(run.get("name"), str) or not isinstance(run.get("dir"), str):
            return f"runs[{i}] is not a run entry with a name and a dir"
        d = run["dir"]
        if not d or d in (".", "..") or "/" in d or "\\" in d or "\0" in d or d.startswith(".") or d == RETIRED:
            return f"runs[{i}] has dir {d[:60]!r}, which is not a directory name inside the sweep"
    return None


def load_sweep_manifest(sweep_dir: Path) -> dict:
    """A sweep dir's `sweep.json`, checked (it is untrusted input: a run `dir` may not point outside the sweep)."""
    path = Path(sweep_dir) / SWEEP_MANIFEST
    if not os.path.lexists(path):
        raise UserError(
            f"{sweep_dir} is not a sweep directory (no {SWEEP_MANIFEST}); sweeps live under runs/sweeps/NAME"
        )
    try:
        data = read_json_object(path)
    except UserError as exc:
        raise UserError(
            f"{exc}; the sweep's record is damaged: restore it, or move it aside and re-run the sweep "
            "command to write a new one"
        ) from None
    problem = _manifest_problem(data)
    if problem:
        raise UserError(f"{path} is damaged: {problem}; restore it, or move it aside and re-run the sweep command")
    return data
