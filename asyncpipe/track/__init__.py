"""Run tracking: atomic run-dir files (config.yaml, metrics.jsonl, summary.json), the run dir's lock and a
best-effort W&B mirror.

Names are loaded on first use, so that `asyncpipe.track.files` and `asyncpipe.track.lock` (standard library only)
can be imported early (asyncpipe.paths, the CLI) without OmegaConf or W&B."""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "RunDir": "files",
    "atomic_write_bytes": "files",
    "atomic_write_json": "files",
    "atomic_write_text": "files",
    "read_summary": "files",
    "DirLock": "lock",
    "Tracker": "tracker",
    "WandbMirror": "wandb_mirror",
    "resolve_mode": "wandb_mirror",
    "sync": "wandb_mirror",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'asyncpipe.track' has no attribute {name!r}")
    return getattr(importlib.import_module(f"asyncpipe.track.{_HOMES[name]}"), name)
