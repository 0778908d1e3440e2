"""A sweep from start to end: expand the grid, compose and validate every run, write the manifest, launch.

Re-running a sweep (same `--name`, or the same `--file`) skips completed runs, resumes unfinished ones and
leaves failed/diverged ones alone unless `retry_failed`. `sweep_status` reads the same state back.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, TextIO

from omegaconf import DictConfig

from asyncpipe.errors import UserError
from asyncpipe.sweep.budgets import family_costs, render_costs, retrain_lost_trunks
from asyncpipe.sweep.configs import RunConfigs
from asyncpipe.sweep.display import SweepDisplay, print_table
from asyncpipe.sweep.expand import SweepPlan, expand, run_overrides
from asyncpipe.sweep.sweepfile import SweepFile, load_sweep_file
from asyncpipe.sweep.local import LocalLauncher, RunCommand, train_command
from asyncpipe.sweep.state import (
    COMPLETED,
    DIVERGED,
    FAILED,
    SLURM_RECORD,
    RunState,
    load_sweep_manifest,
    merged_manifest,
    read_json,
    run_state,
    write_manifest,
)
from asyncpipe.paths import separate_from_runs, writable_dir
from asyncpipe.track.files import SWEEP_MANIFEST, read_summary

DEFAULT_OUT = Path("runs/sweeps")
PROGRESS_MIN_RUNS = 50  # a sweep this large says how its checks progress
PROGRESS_EVERY_S = 2.0


@dataclass
class SweepResult:
    sweep_dir: Path
    plan: SweepPlan
    states: list[RunState]

    @property
    def failed(self) -> list[str]:
        return [s.name for s in self.states if s.state == FAILED]

    def summary(self) -> str:
        n = {k: sum(1 for s in self.states if s.state == k) for k in (COMPLETED, DIVERGED, FAILED)}
        rest = len(self.states) - sum(n.values())
        text = f"sweep {self.plan.name}: {n[COMPLETED]} completed, {n[DIVERGED]} diverged, {n[FAILED]} failed"
        text += f", {rest} not finished" if rest else ""
        text += f" | {self.sweep_dir}"
        if n[FAILED] or n[DIVERGED]:
            text += " | re-run them with --retry-failed"
        return text


def plan_sweep(
    overrides: Sequence[str] = (), file: Optional[Path] = None, name: Optional[str] = None, out: Optional[Path] = None
) -> SweepPlan:
    """The expanded grid of a sweep given on the command line and/or in a sweep file (CLI overrides last). With
    `out`, the grid keys of a sweep of that name already there stay grid keys (`seed=5` extends its seeds)."""
    overrides = list(overrides)
    sf = load_sweep_file(Path(file)) if file is not None else SweepFile(None, [])
    plan = expand(
        sf.overrides + overrides,
        name or sf.name,
        grid_keys=sf.grid_keys,
        variants=sf.variants,
        per=sf.per,
        budgets=sf.budgets,
        variant_budgets=sf.variant_budgets,
    )
    where = Path(out) / plan.name if out is not None else None
    old = load_sweep_manifest(where) if where is not None and (where / SWEEP_MANIFEST).exists() else None
    if old and set(old.get("grid", {})) - set(plan.grid):
        keys = [*sf.grid_keys, *old["grid"]]
        plan = expand(
            sf.overrides + overrides,
            plan.name,
            grid_keys=keys,
            variants=sf.variants,
            per=sf.per,
            budgets=sf.budgets,
            variant_budgets=sf.variant_budgets,
        )
    return plan


def compose_runs(plan: SweepPlan, sweep_dir: Path, progress: Optional[TextIO] = None) -> tuple[RunConfigs, DictConfig]:
    """Check every run's config before anything starts; returns (configs by run, composed when read: see
    `asyncpipe.sweep.configs`, launcher). A large sweep reports its progress on `progress` (stderr by default)
    every few seconds."""
    from asyncpipe.config.validate import check_delay_fits

    stream = progress if progress is not None else sys.stderr
    cfgs = RunConfigs()  # runs that differ only in seed and run dir share one composition
    start = last = time.monotonic()
    for i, spec in enumerate(plan.runs, 1):
        overrides = run_overrides(plan, spec, (sweep_dir / spec.name).resolve(), resume=False)
        try:
            check_delay_fits(cfgs.add(spec.name, [*overrides, *plan.launcher]))
        except UserError as exc:
            raise UserError(f"run {spec.name}: {exc}") from None
        now = time.monotonic()
        if len(plan.runs) >= PROGRESS_MIN_RUNS and (now - last >= PROGRESS_EVERY_S or i == len(plan.runs)):
            left = (now - start) / i * (len(plan.runs) - i)
            print(
                f"checking runs: {i}/{len(plan.runs)} composed and validated, ~{left:.0f} s left",
                file=stream,
                flush=True,
            )
            last = now
    return cfgs, cfgs.template(plan.runs[0].name).launcher


def check_sweep(plan: SweepPlan, out: Path, progress: Optional[TextIO] = None) -> tuple[Path, dict, DictConfig]:
    """Everything a launch refuses, checked without writing anything (the launch and --dry-run both call it):
    the sweep dir's place (writable, never inside or equal to a run dir), every run's config, the existing
    manifest (a sweep can only gain runs) and run records, and a SLURM layout. Returns (sweep dir, configs,
    launcher)."""
    writable_dir(out, "--out")
    sweep_dir = Path(out) / plan.name
    separate_from_runs(sweep_dir, "sweep dir (--out/--name)")
    writable_dir(sweep_dir, "sweep dir (--out/--name)")
    for spec in plan.runs:  # a file where a run dir goes would end the launch halfway
        if (sweep_dir / spec.name).exists() and not (sweep_dir / spec.name).is_dir():
            raise UserError(f"{sweep_dir / spec.name} is a file where run {spec.name} goes; move it away")
    cfgs, launcher = compose_runs(plan, sweep_dir, progress)
    merged_manifest(sweep_dir, plan)
    for spec in plan.runs:  # a re-run must know each run's state: refuse an unreadable record before starting any
        read_summary(sweep_dir / spec.name)
    if launcher.name == "slurm" and any(s.budget is not None for s in plan.runs):
        raise UserError(
            "budgets: branches wait for their family's longest run, which launcher=local does and "
            "launcher=slurm does not yet; run the sweep with launcher=local"
        )
    if launcher.name == "slurm":
        from asyncpipe.sweep.slurm import require_slurm, task_layout

        require_slurm()
        for cfg, _ in cfgs.groups():
            task_layout(cfg)  # refuse an impossible layout before writing anything
    return sweep_dir, cfgs, launcher


def warn_lr_regimes(cfgs: Mapping[str, DictConfig], stream: Optional[TextIO] = None) -> list[str]:
    """Print once each distinct warning of a run whose default lr was tuned for another regime
    (`asyncpipe.config.tuned.regime_warning`), and once that runs will write W&B files offline into their run
    dirs (where, and how to turn it off); returns the lines."""
    from asyncpipe.config.tuned import regime_warning
    from asyncpipe.track.wandb_mirror import resolve_mode

    groups = cfgs.groups() if isinstance(cfgs, RunConfigs) else [(c, 1) for c in cfgs.values()]
    said = list(dict.fromkeys(w for w in (regime_warning(c) for c, _ in groups) if w))
    offline = sum(n for c, n in groups if resolve_mode(str(c.tracker.wandb.mode)) == "offline")
    if offline:
        said.append(
            f"W&B: {offline} of {len(cfgs)} runs write offline into RUN/wandb (no W&B API key, or mode "
            "offline); upload later with `asyncpipe sync SWEEP_DIR`, or turn it off: tracker.wandb.mode=disabled"
        )
    for line in said:
        print(line, file=stream or sys.stderr, flush=True)
    return said


def estimates(plan: SweepPlan, cfgs: RunConfigs, launcher: DictConfig, out: Path) -> Any:
    """The dry-run's estimate (`asyncpipe.sweep.estimate.DryRun`) of every run of the plan."""
    from asyncpipe.sweep.estimate import dry_run
    from asyncpipe.sweep.state import file_state

    sweep_dir = Path(out) / plan.name
    done = {s.name: file_state(sweep_dir / s.name) == COMPLETED for s in plan.runs}
    specs = [(s.name, s.overrides, cfgs.template(s.name), done[s.name]) for s in plan.runs]
    parallel = int(launcher.parallel) if launcher.name == "local" else len(plan.runs)
    return dry_run(specs, parallel, Path(out))


def dry_run_sweep(
    overrides: Sequence[str] = (), *, file: Optional[Path] = None, name: Optional[str] = None, out: Path = DEFAULT_OUT
) -> str:
    """What `run_sweep` would launch (runs, tokens, estimated wall time from recorded runs under `out`), as text;
    refuses what `run_sweep` refuses."""
    from asyncpipe.sweep.estimate import render

    plan = plan_sweep(overrides, file, name, out)
    _, cfgs, launcher = check_sweep(plan, Path(out))
    warn_lr_regimes(cfgs)
    cost = render_costs(family_costs(plan, cfgs))
    return render(plan.name, estimates(plan, cfgs, launcher, Path(out))) + (f"\n{cost}" if cost else "")


def run_sweep(
    overrides: Sequence[str] = (),
    *,
    file: Optional[Path] = None,
    name: Optional[str] = None,
    out: Path = DEFAULT_OUT,
    retry_failed: bool = False,
    wait: bool = True,
    command: RunCommand = train_command,
    display: Optional[SweepDisplay] = None,
) -> SweepResult:
    """Expand, validate and launch a sweep (launcher=local or launcher=slurm); returns every run's state."""
    plan = plan_sweep(overrides, file, name, out)
    sweep_dir, cfgs, launcher = check_sweep(plan, Path(out))
    warn_lr_regimes(cfgs)
    display = display or SweepDisplay(f"sweep {plan.name}")
    try:
        display.expected = {r["name"]: r["seconds"] for r in estimates(plan, cfgs, launcher, Path(out)).rows}
    except (OSError, ValueError):  # an estimate is a nicety: never a reason not to launch
        pass
    cost = render_costs(family_costs(plan, cfgs))
    write_manifest(sweep_dir, plan, **({"budget_cost": cost} if cost else {}))
    if cost:
        print(cost, flush=True)
    for note in retrain_lost_trunks(plan, sweep_dir, cfgs, retry_failed):
        print(note, flush=True)
    if launcher.name == "slurm":
        from asyncpipe.sweep.slurm import SlurmLauncher

        slurm = SlurmLauncher(plan, sweep_dir, cfgs, launcher, retry_failed, command, display)
        states = slurm.run(wait=wait)
    else:
        from asyncpipe.spawn import world_of

        shapes = {s.name: cfgs.template(s.name) for s in plan.runs}
        gpus = {name: 0 if cfg.device == "cpu" else world_of(cfg) for name, cfg in shapes.items()}
        local = LocalLauncher(plan, sweep_dir, int(launcher.parallel), retry_failed, command, display, gpus)
        states = local.run()
    return SweepResult(sweep_dir, plan, states)


def sweep_states(sweep_dir: Path) -> tuple[dict, list[RunState]]:
    """(manifest, state of every run) of a sweep directory; SLURM is asked about runs that have a job."""
    sweep_dir = Path(sweep_dir)
    manifest = load_sweep_manifest(sweep_dir)
    runs = manifest.get("runs", [])
    jobs = []
    for r in runs:
        record = read_json(sweep_dir / r["dir"] / SLURM_RECORD)
        if record and record.get("job_id"):
            jobs.append(str(record["job_id"]))
    slurm: dict[str, str] = {}
    if jobs:
        from asyncpipe.sweep.slurm import slurm_states

        slurm = slurm_states(jobs)
    return manifest, [
        run_state(
            sweep_dir / r["dir"], r["name"], slurm, parent=r.get("parent") if isinstance(r.get("parent"), str) else None
        )
        for r in runs
    ]


def sweep_status(sweep_dir: Path, stream: Optional[TextIO] = None) -> list[RunState]:
    """Print a sweep's run states as a table; returns them."""
    manifest, states = sweep_states(sweep_dir)
    print_table(f"sweep {manifest.get('name')} ({sweep_dir})", states, stream)
    return states
