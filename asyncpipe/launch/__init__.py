"""Launching runs: sweep expansion with Hydra's parser, the local and SLURM (submitit) launchers, sweep state."""

from asyncpipe.launch.expand import RunSpec, SweepPlan, expand
from asyncpipe.launch.sweepfile import SweepFile, load_sweep_file
from asyncpipe.launch.sweep import SweepResult, dry_run_sweep, plan_sweep, run_sweep, sweep_states, sweep_status

__all__ = [
    "RunSpec",
    "SweepPlan",
    "SweepFile",
    "SweepResult",
    "dry_run_sweep",
    "expand",
    "load_sweep_file",
    "plan_sweep",
    "run_sweep",
    "sweep_states",
    "sweep_status",
]
