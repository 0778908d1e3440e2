"""The exception types for mistakes a user can make, and the exit codes of `asyncpipe train`.

The CLI prints a `UserError` as one line and exits 2. Run statuses live in `asyncpipe.status`.
"""


class UserError(Exception):
    """A problem with the user's input (config, data, paths): message says what is wrong and what is allowed."""


class ConfigError(UserError):
    """A config the user composed is invalid."""


class Stopped(Exception):
    """A stop signal (Ctrl-C, SIGTERM, a closed terminal) ended a command that keeps nothing partial (a bench):
    the CLI prints it as one line and exits `EXIT_INTERRUPTED`."""


# Exit codes of `asyncpipe train` (the sweep launchers read them).
EXIT_USER_ERROR = 2  # a UserError: nothing ran
EXIT_DIVERGED = 3  # NaN/inf loss or one above train.diverge_loss
EXIT_INTERRUPTED = 4  # a signal arrived; a checkpoint was written and resume=true continues


# errno -> the limit that was reached: EFBIG, ENOSPC, EDQUOT (Linux numbers)
_WHY = {27: "the per-file size limit (`ulimit -f`)", 28: "the disk is full", 122: "the disk quota is exceeded"}


class WriteFailed(OSError):
    """A file could not be written (a full disk, a quota, a per-file size limit, a read-only place): printed as one
    line naming the file and the reason, plus `then`, what the user can do next (set where that is known)."""

    def __init__(self, path: object, err: OSError, then: str = "") -> None:
        super().__init__(err.errno, err.strerror or str(err), str(path))
        self.then = then

    def __str__(self) -> str:
        limit = _WHY.get(self.errno or 0)
        why = f"{self.strerror}: {limit}" if limit else f"{self.strerror}"
        return f"cannot write {self.filename} ({why})" + (f"; {self.then}" if self.then else "")


def os_error_in(exc: BaseException) -> "OSError | None":
    """The OSError behind `exc` (itself, or one it was raised from: torch.save wraps the write's error)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, OSError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None
