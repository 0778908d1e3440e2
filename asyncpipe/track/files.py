"""The run directory on disk: config.yaml, metrics.jsonl (one JSON object per line) and summary.json.

Whole-file writes are atomic (temp file in the same directory + fsync + os.replace), so a reader or a
crash never sees half a file. JSON has no NaN/inf: such floats are written as `null`.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import math
import os
import stat
import tempfile
import zlib
from pathlib import Path
from typing import Any, Optional

from asyncpipe.errors import UserError, WriteFailed

# The names of run and sweep dir files, defined here only (existing sweep dirs depend on them: never rename).
CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
PROVENANCE_FILE = "provenance.json"  # the code, machine and command a run came from (track.provenance)
LAUNCH_RECORD = "launch.json"  # a sweep's record of the run's last launch (exit code, failed ranks)
SWEEP_LOCK = ".lock"  # held by the sweep or job running the run (track.lock.DirLock.sweep)
WRITER_LOCK = ".writer.lock"  # held by the process writing the run dir (track.lock.DirLock.writer)
BRANCH_RECORD = "branch.json"  # a budget branch's parent run and the step it started from (trainer.Trainer.branch)
SWEEP_MANIFEST = "sweep.json"  # a sweep dir's manifest: grid, variants, every run's overrides
RETIRED = ".retired"  # in a sweep dir: failed attempts moved aside by --retry-failed (not runs of the sweep)
_SECRET_ENV = "WANDB_API_KEY"
# The most a reader takes from one run-dir file (a run dir is untrusted input: a results tarball, shared scratch).
MAX_SMALL_FILE = 4 << 20  # config.yaml, summary.json, provenance.json, sweep.json, launch.json
MAX_METRICS_FILE = 512 << 20  # metrics.jsonl: one line per logged step (~200 bytes); 2.5M steps fit


class UnreadableFile(UserError):
    """A file of a run or sweep dir that cannot be trusted as what it claims to be (not a regular file, too large,
    not UTF-8, not the JSON/YAML type it should hold): one line naming the file and why."""


# The one list of settings that cannot change a result: a resume may change them, and a report never compares them.
NO_RESULT_PREFIXES = ("run.", "tracker.", "launcher.", "checkpoint.")
NO_RESULT_KEYS = frozenset(
    {
        "resume",
        "train.log_every",
        "pipeline.trace",
        "pipeline.threads",
        "pipeline.backend",
        "data.root",
        "data.workers",
        "data.shard_mb",
    }
)


def changes_no_result(key: str) -> bool:
    """Whether a dotted config key is one of the settings that cannot change a run's numbers."""
    return key in NO_RESULT_KEYS or key.startswith(NO_RESULT_PREFIXES)


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "directory"),
        (stat.S_ISFIFO, "FIFO"),
        (stat.S_ISSOCK, "socket"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
    ):
        if test(mode):
            return name
    return "special file"


def _read_regular(path: Path, max_bytes: int, inflate: bool = False) -> bytes:
    """At most `max_bytes` of a regular file (a FIFO would block the open forever, a device never ends); with
    `inflate`, of the gzip stream it holds, the compressed file capped too. Anything else is an `UnreadableFile`;
    `FileNotFoundError` passes through (callers decide what a missing file means)."""
    try:
        # O_NONBLOCK: a FIFO put in place of the file opens without waiting for a writer; fstat then refuses it.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise
    except IsADirectoryError:
        raise UnreadableFile(f"{path} is a directory, not a file") from None
    except OSError as err:
        raise UnreadableFile(f"{path} cannot be opened ({err.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnreadableFile(f"{path} is a {_kind(st.st_mode)}, not a regular file")
        if st.st_size > max_bytes:
            raise UnreadableFile(
                f"{path} is {st.st_size / 2**20:.1f} MiB, above the {max_bytes / 2**20:g} MiB a "
                "reader takes from such a file"
            )
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb", closefd=True) as f:
            fd = -1
            if not inflate:
                data = f.read(max_bytes + 1)
            else:
                with gzip.GzipFile(fileobj=f) as g:
                    data = g.read(max_bytes + 1)
    except (EOFError, zlib.error, gzip.BadGzipFile) as err:
        raise UnreadableFile(f"{path} is not a readable gzip file ({err})") from None
    except OSError as err:
        raise UnreadableFile(f"{path} cannot be read ({err.strerror or err})") from None
    finally:
        if fd >= 0:
            os.close(fd)
    if len(data) > max_bytes:  # grew since fstat, or inflated past the cap
        what = "inflates to more than" if inflate else "is above"
        raise UnreadableFile(f"{path} {what} the {max_bytes / 2**20:g} MiB a reader takes from such a file")
    return data


def _utf8(path: Path, data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise UnreadableFile(f"{path} is not UTF-8 text (byte {err.start} is 0x{data[err.start]:02x})") from None


def read_untrusted(path: str | os.PathLike, max_bytes: int = MAX_SMALL_FILE) -> str:
    """The UTF-8 text of a file read from a run or sweep dir, which is untrusted input: only a regular file, at most
    `max_bytes`, strict UTF-8; anything else is an `UnreadableFile`. `FileNotFoundError` passes through."""
    return _utf8(Path(path), _read_regular(Path(path), max_bytes))


def read_untrusted_gz(path: str | os.PathLike, max_bytes: int = MAX_SMALL_FILE) -> str:
    """`read_untrusted` for a gzip-compressed record (committed study records store metrics.jsonl.gz): the
    compressed file and the text it inflates to are each capped at `max_bytes` (a small bomb cannot fill memory)."""
    return _utf8(Path(path), _read_regular(Path(path), max_bytes, inflate=True))


def read_json_object(path: str | os.PathLike, max_bytes: int = MAX_SMALL_FILE) -> dict:
    """A JSON object from an untrusted file (`read_untrusted`); invalid JSON or another type is `UnreadableFile`."""
    try:
        data = json.loads(read_untrusted(path, max_bytes))
    except ValueError as err:
        raise UnreadableFile(f"{path} is not valid JSON ({str(err).split(':')[0]})") from None
    except RecursionError:
        raise UnreadableFile(f"{path} nests too deeply to be a record") from None
    if not isinstance(data, dict):
        raise UnreadableFile(f"{path} holds a JSON {type(data).__name__}, not an object")
    return data


def umask() -> int:
    """This process's umask, read without changing it (Linux), else set and restored."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    old = os.umask(0o022)
    os.umask(old)
    return old


def file_mode() -> int:
    """The mode a new file gets here (0644 under umask 022): what a file written through a temporary file (which
    mkstemp creates 0600) is given, so a collaborator reads a run's checkpoints as they read the rest of it."""
    return 0o666 & ~umask()


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` so that readers see either the old file or the whole new one. A failed write (a full
    disk, a size limit) is a `WriteFailed` naming the file; the old file is left as it was."""
    path = Path(path)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, file_mode())
        os.replace(tmp, path)
    except BaseException as err:
        if tmp is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        if isinstance(err, OSError) and not isinstance(err, WriteFailed):
            raise WriteFailed(path, err) from None
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


MAX_YAML_NODES = 200_000  # a YAML document expanded (aliases counted at every use); an alias bomb is far above


def _expanded_size(node: Any, source: str) -> int:
    """Nodes in `node` with every alias expanded, counted without expanding (each node once, memoised)."""
    import yaml

    sizes: dict[int, int] = {}
    open_: set[int] = set()

    def size(n: Any) -> int:
        key = id(n)
        if key in sizes:
            return sizes[key]
        if key in open_:
            raise UnreadableFile(f"{source}: an alias refers to the node that holds it (a YAML loop)")
        open_.add(key)
        if isinstance(n, yaml.MappingNode):
            children = [c for pair in n.value for c in pair]
        else:
            children = list(n.value) if isinstance(n, yaml.SequenceNode) else []
        total = 1
        for child in children:
            total += size(child)
            if total > MAX_YAML_NODES:
                raise UnreadableFile(
                    f"{source}: expands to more than {MAX_YAML_NODES:,} YAML nodes (aliases "
                    "counted at every use, e.g. an alias bomb); write it out plainly"
                )
        open_.discard(key)
        sizes[key] = total
        return total

    return size(node)


def load_untrusted_yaml(text: str, source: str, loader_cls: Any = None) -> tuple[Any, Any]:
    """(data, composed root node) of YAML `text` that may be hostile: composed first (aliases stay references),
    its expanded size capped at `MAX_YAML_NODES`, only then built into Python objects (`loader_cls`, default
    yaml.SafeLoader). Invalid YAML, a nesting too deep and an alias bomb are one-line `UnreadableFile`s."""
    import yaml

    loader = (loader_cls or yaml.SafeLoader)(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None, None
        _expanded_size(node, source)
        return loader.construct_document(node), node
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        why = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise UnreadableFile(f"{source} is not valid YAML{where}: {why}") from None
    except RecursionError:
        raise UnreadableFile(f"{source} nests too deeply to be read") from None
    finally:
        loader.dispose()


def parse_metrics_lines(text: str, source: str) -> list[dict]:
    """Metric records from metrics.jsonl text; an incomplete last line (a crash mid-write) is ignored. A line that
    is not a JSON object is an `UnreadableFile`."""
    lines = text.split("\n")
    records = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            if i == len(lines) - 1:  # the unterminated tail of an interrupted append
                break
            raise UnreadableFile(f"{source}:{i + 1} is not valid JSON; fix or remove that line") from None
        if not isinstance(record, dict):
            raise UnreadableFile(f"{source}:{i + 1} holds a JSON {type(record).__name__}, not an object")
        records.append(record)
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
        try:
            with open(self.metrics_path, "a", encoding="utf-8") as f:
                f.write(line)
                f.flush()
        except OSError as err:  # a partial line is dropped on resume (`_repair_tail`)
            raise WriteFailed(self.metrics_path, err) from None

    def _repair_tail(self) -> None:
        """Drop an unterminated last line left by a crash, so the next append starts on a fresh line."""
        self._tail_checked = True
        if not os.path.lexists(self.metrics_path):
            return
        if not self.metrics_path.is_file():  # a FIFO would block the read below forever
            raise UnreadableFile(f"{self.metrics_path} is not a regular file; remove it or choose another run.dir")
        data = self.metrics_path.read_bytes()
        if data and not data.endswith(b"\n"):
            atomic_write_bytes(self.metrics_path, data[: data.rfind(b"\n") + 1])

    def read_metrics(self) -> list[dict]:
        try:
            text = read_untrusted(self.metrics_path, MAX_METRICS_FILE)
        except FileNotFoundError:
            return []
        return parse_metrics_lines(text, str(self.metrics_path))

    def truncate_metrics(self, after_step: int, records: Optional[list[dict]] = None) -> int:
        """Drop records with step > after_step (a resume from that checkpoint); returns how many were dropped.
        ``records``: start from these instead of this run's own (a budget branch starts with its parent's)."""
        records = self.read_metrics() if records is None else records
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
    if not os.path.lexists(path):
        return None
    try:
        return read_json_object(path)
    except (FileNotFoundError, UnreadableFile) as err:
        why = str(err).removeprefix(str(path)).strip() or "gone while read"
        raise UnreadableFile(
            f"{path} is not a readable run summary ({why}), so the run's state is unknown; remove that file to "
            "resume from the latest checkpoint, or remove the run dir to start over"
        ) from None
