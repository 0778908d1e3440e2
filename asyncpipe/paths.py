"""Checks on the paths a command will write, made before it writes anything: one-line `UserError`s instead of
an `OSError` traceback halfway through (and a half-made run dir or report left behind).

Only the standard library, asyncpipe.errors and the run dir's file names (asyncpipe.track.files): the CLI calls
these before its heavy imports.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Union

from asyncpipe.errors import UserError
from asyncpipe.track.files import (
    CONFIG_FILE,
    LAUNCH_RECORD,
    METRICS_FILE,
    PROVENANCE_FILE,
    SUMMARY_FILE,
    SWEEP_MANIFEST,
    WRITER_LOCK,
)

PathLike = Union[str, "os.PathLike[str]"]


def _nearest_existing(path: Path) -> Path:
    """`path` itself or its closest ancestor that exists (a file or a directory)."""
    node = path
    while True:
        try:
            node.stat()
            return node
        except (FileNotFoundError, NotADirectoryError):
            if node.parent == node:
                return node
            node = node.parent
        except OSError as err:  # e.g. a directory we may not search
            raise UserError(f"cannot check {node} ({err.strerror}); choose a path you can write to") from None


def writable_dir(path: PathLike, what: str, fix: str = "") -> Path:
    """A directory this command will create or write into: refuse an existing file there, a path below a file
    and an ancestor (or the directory itself) we may not write to. `what` names the setting, e.g. ``run.dir``;
    `fix` says what to do (default: choose another `what`)."""
    path = Path(os.path.expanduser(str(path)))
    fix = fix or f"choose another {what}"
    found = _nearest_existing(path)
    if found == path and not path.is_dir():
        raise UserError(f"{what} {path} is a file, not a directory; {fix}")
    if not found.is_dir():
        raise UserError(f"{what} {path} is below {found}, which is a file; {fix}")
    if not os.access(found, os.W_OK | os.X_OK):
        where = "it" if found == path else f"{found}"
        raise UserError(f"{what} {path}: cannot write to {where} (permission denied); {fix}")
    return path


def writable_file(path: PathLike, what: str) -> Path:
    """A file this command will (over)write: not a directory, in a directory `writable_dir` accepts."""
    path = Path(os.path.expanduser(str(path)))
    if path.is_dir():
        raise UserError(f"{what} {path} is a directory; give a file name")
    writable_dir(path.parent, f"the directory of {what}", f"choose another {what}")
    if path.exists() and not os.access(path, os.W_OK):
        raise UserError(f"{what} {path}: cannot write to it (permission denied); choose another {what}")
    return path


def own_dir(path: PathLike, what: str = "run.dir") -> Path:
    """A run's own directory: not the working directory, a directory above it, or the home directory, where a run's
    files would mix with everything else (`run.dir=.` used to train into the current directory)."""
    path = Path(os.path.expanduser(str(path)))
    full, cwd = path.resolve(), Path.cwd().resolve()
    place = (
        "the working directory"
        if full == cwd
        else "above the working directory"
        if full in cwd.parents
        else "your home directory"
        if full == Path.home().resolve()
        else None
    )
    if place:
        raise UserError(f"{what}={path} is {place}; give the run a directory of its own, e.g. {what}=runs/NAME")
    run_dir_place(path, what)
    return writable_dir(path, what)


def data_root(root: PathLike, prepared: bool = False) -> Path:
    """The data root (`data.root`, default $ASYNCPIPE_DATA): a directory, writable unless the dataset a command
    reads is already `prepared` there (reading prepared data from a read-only root is fine)."""
    if not str(root).strip():  # Path("") is the working directory: token files would land among the user's files
        raise UserError(
            "the data root is empty (ASYNCPIPE_DATA is set to ''); unset it (default: data_cache) or point "
            "it (or data.root) at a directory"
        )
    path = Path(os.path.expanduser(str(root)))
    if prepared:
        return path
    return writable_dir(path, "data root", "point ASYNCPIPE_DATA (or data.root) at a directory you can write to")


# A directory holds a run's record when it has the run's config.yaml and any of what training writes next to it.
RUN_RECORD = (CONFIG_FILE,)
RUN_TRACES = (METRICS_FILE, SUMMARY_FILE, PROVENANCE_FILE, WRITER_LOCK, "checkpoints", LAUNCH_RECORD)


def is_run_dir(path: PathLike) -> bool:
    """True when `path` holds a run's record (config.yaml and something training writes beside it)."""
    path = Path(path)
    try:
        return (
            path.is_dir()
            and all(os.path.lexists(path / f) for f in RUN_RECORD)
            and any(os.path.lexists(path / f) for f in RUN_TRACES)
        )
    except OSError:
        return False


def enclosing_run(path: PathLike, strict: bool = False) -> "Path | None":
    """The run dir that `path` lies in (itself included unless `strict`), or None. The path need not exist yet."""
    full = Path(os.path.abspath(os.path.expanduser(str(path))))
    for node in ([] if strict else [full]) + list(full.parents):
        if is_run_dir(node):
            return node
    return None


def separate_from_runs(path: PathLike, what: str) -> Path:
    """A sweep dir or report output: never inside a run dir, never a run dir itself (runs, sweeps and reports do
    not nest: a report would miss the nested runs, and a run's record would gain files it did not write)."""
    path = Path(os.path.expanduser(str(path)))
    holder = enclosing_run(path)
    if holder is not None:
        where = "is a run dir" if holder == Path(os.path.abspath(path)) else f"is inside run dir {holder}"
        raise UserError(
            f"{what} {path} {where}; runs, sweeps and reports never nest: choose a {what} outside every run dir"
        )
    return path


def run_dir_place(path: PathLike, what: str = "run.dir") -> Path:
    """A run dir is neither inside another run dir (its checkpoints/ included) nor a sweep dir."""
    text = str(path)
    bad = next((c for c in text if ord(c) < 32 or ord(c) == 127), None)
    if bad is not None:  # a newline would split a report's table row, a log line, a sweep status line
        raise UserError(
            f"{what}={text!r} holds a control character ({bad!r}); name the run dir with printable characters only"
        )
    path = Path(os.path.expanduser(text))
    holder = enclosing_run(path, strict=True)
    if holder is not None:
        raise UserError(
            f"{what}={path} is inside run dir {holder}; a run inside another run's record is hidden from "
            f"reports: choose a {what} outside every run dir"
        )
    if os.path.lexists(path / SWEEP_MANIFEST):
        raise UserError(f"{what}={path} is a sweep directory (it holds {SWEEP_MANIFEST}); choose a run dir of its own")
    return path
