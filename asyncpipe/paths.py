"""Checks on the paths a command will write, made before it writes anything: one-line `UserError`s instead of
an `OSError` traceback halfway through (and a half-made run dir or report left behind).

Only the standard library and asyncpipe.errors: the CLI calls these before its heavy imports.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Union

from asyncpipe.errors import UserError

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
    place = ("the working directory" if full == cwd else "above the working directory" if full in cwd.parents
             else "your home directory" if full == Path.home().resolve() else None)  # fmt: skip
    if place:
        raise UserError(f"{what}={path} is {place}; give the run a directory of its own, e.g. {what}=runs/NAME")
    return writable_dir(path, what)


def data_root(root: PathLike, prepared: bool = False) -> Path:
    """The data root (`data.root`, default $ASYNCPIPE_DATA): a directory, writable unless the dataset a command
    reads is already `prepared` there (reading prepared data from a read-only root is fine)."""
    path = Path(os.path.expanduser(str(root)))
    if prepared:
        return path
    return writable_dir(path, "data root", "point ASYNCPIPE_DATA (or data.root) at a directory you can write to")
