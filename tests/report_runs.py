"""Synthetic run dirs for the report tests: a completed run's config, val-loss curve and summary, and a sweep dir."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import yaml

from asyncpipe.track import RunDir


def write(root: Path, variant: str, opt: str, seed: int, finals: list[tuple[int, float]], steps: int = 100,
          lr: float = 1e-3, name: Optional[str] = None) -> None:  # fmt: skip
    """A completed run of `variant` (delay 0 for sync, else 1; EF when the name holds `+EF`) whose val loss is
    `loss` at each (tokens, loss); its dir is ROOT/NAME (default `{opt}-{variant}-s{seed}`)."""
    cfg = {"model": {"name": "tiny"}, "data": {"name": "hamlet"}, "seed": seed, "delay": int(variant != "sync"),
           "engine": "simulate", "delay_profile": "uniform", "pipeline": {"stages": 2},
           "train": {"steps": steps, "micro_batches": 4},
           "optimizer": {"name": opt, "lr": lr, "ef": {"enabled": "+EF" in variant, "lam": 1.0}},
           "run": {"variant": variant}}  # fmt: skip
    run = RunDir(root / (name or f"{opt}-{variant}-s{seed}"))
    run.write_config(yaml.safe_dump(cfg))
    for i, (tokens, loss) in enumerate(finals):
        run.append_metrics({"step": i, "tokens": tokens, "val_loss": loss})
    run.write_summary({"status": "completed", "final_val_loss": finals[-1][1], "tokens": finals[-1][0]})


def sweep(root: Path, name: str, variants: list[str]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "sweep.json").write_text(json.dumps({"name": name, "variants": {v: [] for v in variants}}))
    return root


def line(final: float, end: int = 5000) -> list[tuple[int, float]]:
    return [(t, final + (end - t) / 1000 * 0.25) for t in range(1000, end + 1, 1000)]
