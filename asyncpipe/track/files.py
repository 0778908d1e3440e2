"""The run directory on disk: config.yaml, metrics.jsonl (one JSON object per line) and summary.json.

Whole-file writes are atomic (temp file in the same directory + fsync + os.replace), so a reader or a
crash never sees half a file. JSON has no NaN/inf: such floats are written as `null`.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

from asyncpipe.errors import UserError

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
_SECRET_ENV = "WANDB_API_KEY"


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` so that readers see either the old file or the whole new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        # mkstemp creates 0600; run files are meant to be shared like any other output.
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Atomically write UTF-8 text."""
    atomic_write_bytes(path, text.encode("utf-8"))


def jsonable(value: Any) -> Any:
    """`value` made JSON-safe: NaN/inf -> None, tensors/numpy scalars -> Python numbers, Paths -> str."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if hasattr(value, "item"):  # 0-d tensors and numpy scalars, without importing either library
        return jsonable(value.item())
    return str(value)


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    """Atomically write `obj` as indented JSON (NaN/inf become null)."""
    atomic_write_text(path, json.dumps(jsonable(obj), indent=2, allow_nan=False) + "\n")


def redact_secrets(text: str) -> str:
    """`text` with the W&B API key from the environment (if any) replaced, so it can never reach a file."""
    secret = os.environ.get(_SECRET_ENV, "")
    return text.replace(secret, "<redacted>") if len(secret) >= 8 else text


def parse_metrics_lines(text: str, source: str) -> list[dict]:
    """Metric records from metrics.jsonl text; an incomplete last line (a crash mid-write) is ignored."""
    lines = text.split("\n")
    records = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:  # the unterminated tail of an interrupted append
                break
            raise UserError(f"{source}:{i + 1} is not valid JSON; fix or remove that line") from None
    return records


class RunDir:
    """One run's directory. Only rank 0 of a run should write to it."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self._tail_checked = False

    @property
    def config_path(self) -> Path:
        return self.path / CONFIG_FILE

    @property
    def metrics_path(self) -> Path:
        return self.path / METRICS_FILE

    @property
    def summary_path(self) -> Path:
        return self.path / SUMMARY_FILE

    def write_config(self, yaml_text: str) -> None:
        atomic_write_text(self.config_path, redact_secrets(yaml_text))

    def append_metrics(self, metrics: dict) -> None:
        """Append one JSON line (NaN/inf -> null) and flush it, so a crash loses at most this line."""
        if not self._tail_checked:
            self._repair_tail()
        line = json.dumps(jsonable(metrics), allow_nan=False) + "\n"
        # Opened per line: truncate_metrics replaces the file, so a long-lived handle would go stale.
        with open(self.metrics_path, "a", encoding="utf-8") as f:
            f.write(line)
            f.flush()

    def _repair_tail(self) -> None:
        """Drop an unterminated last line left by a crash, so the next append starts on a fresh line."""
        self._tail_checked = True
        if not self.metrics_path.exists():
            return
        data = self.metrics_path.read_bytes()
        if data and not data.endswith(b"\n"):
            atomic_write_bytes(self.metrics_path, data[: data.rfind(b"\n") + 1])

    def read_metrics(self) -> list[dict]:
        if not self.metrics_path.exists():
            return []
        return parse_metrics_lines(self.metrics_path.read_text(encoding="utf-8"), str(self.metrics_path))

    def truncate_metrics(self, after_step: int) -> int:
        """Drop records with step > after_step (a resume from that checkpoint); returns how many were dropped."""
        records = self.read_metrics()
        kept = [r for r in records if r.get("step") is None or r["step"] <= after_step]
        text = "".join(json.dumps(r, allow_nan=False) + "\n" for r in kept)
        atomic_write_text(self.metrics_path, text)
        self._tail_checked = True
        return len(records) - len(kept)

    def write_summary(self, summary: dict) -> None:
        """Write summary.json: keys status (running/completed/diverged/failed), final_val_loss, tokens, wall_time."""
        atomic_write_text(
            self.summary_path,
            redact_secrets(json.dumps(jsonable(summary), indent=2, allow_nan=False) + "\n"),
        )

    def read_summary(self) -> dict | None:
        return read_summary(self.path)


def read_summary(run_dir: str | os.PathLike) -> dict | None:
    """A run dir's summary.json (None when it has none); an unreadable one is a `UserError`, never a guess."""
    path = Path(run_dir) / SUMMARY_FILE
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        data = err
    if not isinstance(data, dict):
        why = f" ({data})" if isinstance(data, Exception) else ""
        raise UserError(
            f"{path} is not a readable run summary{why}, so the run's state is unknown; remove that file to "
            "resume from the latest checkpoint, or remove the run dir to start over"
        )
    return data
