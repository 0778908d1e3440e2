"""`Tracker`: the one object a trainer logs through; writes the run dir (rank 0) and mirrors to W&B."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Callable

from asyncpipe.status import COMPLETED
from asyncpipe.track.files import RunDir
from asyncpipe.track.wandb_mirror import WandbMirror


class Tracker:
    """Rank 0 writes metrics.jsonl / summary.json and mirrors them to W&B; other ranks do nothing."""

    def __init__(self, cfg: Any, run_dir: str | os.PathLike, rank: int = 0, say: Callable[[str], Any] | None = None):
        self.rank = rank
        self.run: RunDir | None = RunDir(run_dir) if rank == 0 else None
        self.wandb = WandbMirror(cfg, Path(run_dir), rank)
        if self.wandb.active and self.wandb.mode == "offline":  # files appear in the run dir: say where, and why
            (say or (lambda m: print(m, file=sys.stderr, flush=True)))(offline_note(Path(run_dir)))

    def log(self, metrics: dict) -> None:
        """One metrics record; must carry `step` (the W&B step)."""
        if self.run is None:
            return
        self.run.append_metrics(metrics)
        self.wandb.log(metrics, step=int(metrics["step"]))

    def finish(self, summary: dict) -> None:
        """Write summary.json and end the W&B run (exit code 0 only for status=completed)."""
        if self.run is None:
            return
        self.run.write_summary(summary)
        self.wandb.summary(summary)
        self.wandb.finish(exit_code=0 if summary.get("status") == COMPLETED else 1)


def offline_note(run_dir: Path) -> str:
    return (
        f"W&B: writing this run offline to {run_dir / 'wandb'} (upload later: asyncpipe sync "
        f"{run_dir}; tracker.wandb.mode=disabled turns W&B off)"
    )
