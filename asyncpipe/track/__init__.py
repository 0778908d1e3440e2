"""Run tracking: atomic run-dir files (config.yaml, metrics.jsonl, summary.json) and a best-effort W&B mirror."""

from asyncpipe.track.files import RunDir, atomic_write_bytes, atomic_write_json, atomic_write_text, read_summary
from asyncpipe.track.tracker import Tracker
from asyncpipe.track.wandb_mirror import WandbMirror, resolve_mode, sync

__all__ = [
    "RunDir",
    "Tracker",
    "WandbMirror",
    "atomic_write_bytes",
    "atomic_write_json",
    "atomic_write_text",
    "read_summary",
    "resolve_mode",
    "sync",
]
