"""Launching runs: sweep expansion with Hydra's parser, the local and SLURM (submitit) launchers, sweep state."""

from asyncpipe.launch.expand import RunSpec, SweepPlan, expand, load_sweep_file
from asyncpipe.launch.sweep import SweepResult, plan_sweep, run_sweep, sweep_states, sweep_status

__all__ = [
    "RunSpec",
    "SweepPlan",
    "SweepResult",
    "expand",
    "load_sweep_file",
    "plan_sweep",
    "run_sweep",
    "sweep_states",
    "sweep_status",
]
