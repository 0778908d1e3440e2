"""One run dir's files read as untrusted input: its config.yaml, summary.json, metrics.jsonl (or the committed
record's metrics.jsonl.gz) and provenance.json. A file that cannot be trusted as a record (not a regular file, too
large, not UTF-8, wrong JSON/YAML types, non-finite numbers) is a `DamagedRun` naming it and why; `load` turns the
files into a run's row and its evaluation rows.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from asyncpipe.errors import UserError
from asyncpipe.track.files import (
    CONFIG_FILE,
    MAX_METRICS_FILE,
    METRICS_FILE,
    PROVENANCE_FILE,
    SUMMARY_FILE,
    load_untrusted_yaml,
    parse_metrics_lines,
    read_json_object,
    read_untrusted,
    read_untrusted_gz,
)


class DamagedRun(UserError):
    """A run dir whose files cannot be trusted as a record (see asyncpipe.track.files.read_untrusted)."""


def _number(value: Any, what: str, source: str, integer: bool = False) -> Any:
    """A finite number (bools and strings are not numbers) or None; anything else damages the run."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise DamagedRun(f"{source}: {what} is {str(value)[:40]!r}, not a finite number")
    return int(value) if integer else value


def _check_records(metrics: list[dict], source: str) -> None:
    for i, rec in enumerate(metrics, 1):
        tokens = rec.get("tokens")
        if tokens is not None and (_number(tokens, "tokens", f"{source} record {i}") < 0):
            raise DamagedRun(f"{source} record {i}: tokens is {tokens}, below 0")
        for key in ("val_loss", "train_loss"):
            value = rec.get(key)
            # null is how a non-finite loss is written (a diverged step); text or a nested value is damage
            if value is not None and (isinstance(value, (bool, str, list, dict))):
                raise DamagedRun(f"{source} record {i}: {key} is {str(value)[:40]!r}, not a number")


def read_config(run: Path) -> dict:
    """A run's config.yaml as a mapping (untrusted: size, type, encoding and alias expansion checked)."""
    path = run / CONFIG_FILE
    config, _ = load_untrusted_yaml(read_untrusted(path), str(path))
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise DamagedRun(f"{path} holds a YAML {type(config).__name__}, not a mapping of settings")
    return config


def read_summary(run: Path) -> dict | None:
    """A run's summary.json as a mapping (its numbers finite, its status a name), or None when it has none."""
    if not os.path.lexists(run / SUMMARY_FILE):
        return None
    summary = read_json_object(run / SUMMARY_FILE)
    for key in ("tokens", "final_val_loss", "wall_time", "steps", "epochs", "branch_step"):
        _number(summary.get(key), key, str(run / SUMMARY_FILE))
    if not isinstance(summary.get("status", ""), (str, type(None))):
        raise DamagedRun(f"{run / SUMMARY_FILE}: status is {summary['status']!r}, not a name")
    return summary


def read_metrics(run: Path) -> tuple[list[dict], str]:
    """A run's metric records, and a note when the last line of metrics.jsonl was cut off (it is ignored). A
    committed study record stores its curves compressed (metrics.jsonl.gz), read when metrics.jsonl is absent."""
    metrics, note = [], ""
    packed = run / (METRICS_FILE + ".gz")
    if not os.path.lexists(run / METRICS_FILE) and os.path.lexists(packed):
        text = read_untrusted_gz(packed, MAX_METRICS_FILE)
        metrics = parse_metrics_lines(text, str(packed))
        _check_records(metrics, str(packed))
    elif os.path.lexists(run / METRICS_FILE):
        text = read_untrusted(run / METRICS_FILE, MAX_METRICS_FILE)
        metrics = parse_metrics_lines(text, str(run / METRICS_FILE))
        _check_records(metrics, str(run / METRICS_FILE))
        if text.strip() and not text.endswith("\n") and len(metrics) < len([x for x in text.split("\n") if x.strip()]):
            note = f"last line of {METRICS_FILE} is cut off (a crash mid-write): ignored, the {len(metrics)} lines before it are used"
    return metrics, note


def read_provenance(run: Path) -> dict | None:
    """A run's provenance.json as a mapping, or None (absent or unreadable: the report says "unrecorded")."""
    try:
        return read_json_object(run / PROVENANCE_FILE)
    except (OSError, UserError):
        return None


def code_of(prov: dict | None) -> str:
    """The code a run came from, from its provenance.json: `commit[ (dirty)]; package versions`, or "unrecorded"."""
    if prov is None:
        return "unrecorded"
    git = prov.get("git") if isinstance(prov.get("git"), dict) else {}
    versions = prov.get("versions") if isinstance(prov.get("versions"), dict) else {}
    commit = str(git.get("commit") or "no git")[:10] + (" (dirty)" if git.get("dirty") else "")
    others = ", ".join(f"{k} {v}" for k, v in versions.items() if v and k != "asyncpipe")
    return f"{commit}; asyncpipe {versions.get('asyncpipe')}; {others}"
