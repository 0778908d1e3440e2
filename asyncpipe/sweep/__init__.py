"""Sweeps: expansion with Hydra's override parser, the local and SLURM (submitit) launchers of a sweep's runs,
sweep state."""

from asyncpipe.sweep.expand import RunSpec, SweepPlan, expand
from asyncpipe.sweep.sweepfile import SweepFile, load_sweep_file
from asyncpipe.sweep.runner import SweepResult, dry_run_sweep, plan_sweep, run_sweep, sweep_states, sweep_status

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
