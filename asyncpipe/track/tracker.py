"""`Tracker`: the one object a trainer logs through; writes the run dir (rank 0) and mirrors to W&B."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from asyncpipe.status import COMPLETED
from asyncpipe.track.files import RunDir
from asyncpipe.track.wandb_mirror import WandbMirror


class Tracker:
    """Rank 0 writes metrics.jsonl / summary.json and mirrors them to W&B; other ranks do nothing."""

    def __init__(self, cfg: Any, run_dir: str | os.PathLike, rank: int = 0):
        self.rank = rank
        self.run: RunDir | None = RunDir(run_dir) if rank == 0 else None
        self.wandb = WandbMirror(cfg, Path(run_dir), rank)

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
