"""What a long run cannot trust about the process it runs in, checked or guarded at the command's edge (standard
library only, before any heavy import): a working directory deleted under the shell, and standard streams that
are closed at start (`>&-`), go away mid-run (`| head -1`, a closed terminal) or take ASCII only
(`LC_ALL=C PYTHONIOENCODING=ascii`).

Output never ends a run: a stream that fails is pointed at /dev/null and its writes are dropped from then on, and
`GuardedStream.broken` says why (the run's train.log notes it once: `asyncpipe.track.provenance.LogTee`); text a
stream cannot encode degrades to ASCII (± -> +/-, − -> -, × -> x; anything else -> ?).
"""

from __future__ import annotations

import codecs
import contextlib
import io
import os
import sys
import unicodedata
from typing import Any, Iterator, Optional, TextIO

from asyncpipe.errors import UserError

ASCII_FALLBACK = "asyncpipe-ascii"  # the codec error handler below
_PLAIN = {
    "±": "+/-",
    "−": "-",
    "×": "x",
    "–": "-",
    "—": "--",
    "…": "...",
    "≥": ">=",
    "≤": "<=",
    "≈": "~",
    "→": "->",
    "←": "<-",
    "·": ".",
    "°": "deg",
    "µ": "u",
    "‘": "'",
    "’": "'",
    "“": '"',
    "”": '"',
    "█": "#",
    "━": "-",
    "─": "-",
    "│": "|",
    "•": "*",
    "✓": "ok",
    "✗": "x",
}


def plain(char: str) -> str:
    """An ASCII stand-in for one character: a known one's, else its compatibility decomposition's, else ?."""
    if char in _PLAIN:
        return _PLAIN[char]
    ascii_part = unicodedata.normalize("NFKD", char).encode("ascii", "ignore").decode("ascii")
    return ascii_part or "?"


def _fallback(err: UnicodeError) -> tuple[str, int]:
    if not isinstance(err, UnicodeEncodeError):
        raise err
    return "".join(plain(c) for c in err.object[err.start : err.end]), err.end


codecs.register_error(ASCII_FALLBACK, _fallback)


def check_cwd() -> None:
    """Refuse, in one line, to start in a working directory that no longer exists (deleted under the shell): every
    relative path would fail later, and torch's own import dies of it with an MKL error."""
    try:
        os.getcwd()
    except FileNotFoundError:
        pwd = os.environ.get("PWD", "")
        where = f" ({pwd})" if pwd else ""
        raise UserError(
            f"the working directory{where} no longer exists (deleted under the shell); cd to a directory "
            "that exists and run the command again"
        ) from None


class GuardedStream:
    """Stands in for sys.stdout or sys.stderr: writes through until the stream fails (a closed pipe or terminal,
    a closed descriptor), then drops output; `broken` says what happened (None while it works)."""

    def __init__(self, stream: Optional[TextIO], name: str, broken: Optional[str] = None) -> None:
        if stream is None:  # Python found the descriptor closed: a stand-in, so `.encoding` or `.fileno()` work
            stream = open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115 (lives as long as the process)
            broken = broken or f"{name} was closed when asyncpipe started"
        self.stream, self.name, self.broken = stream, name, broken

    def write(self, text: str) -> int:
        if self.broken is None:
            try:
                return self.stream.write(text)
            except (OSError, ValueError) as err:  # ValueError: a closed file object
                self._break(err)
        return len(text)

    def flush(self) -> None:
        if self.broken is None:
            try:
                self.stream.flush()
            except (OSError, ValueError) as err:
                self._break(err)

    def _break(self, err: Exception) -> None:
        why = getattr(err, "strerror", None) or str(err) or type(err).__name__
        self.broken = f"{self.name} went away ({why})"
        with contextlib.suppress(Exception):  # the interpreter's own flush at exit must not fail on it either
            fd = self.stream.fileno()
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, fd)
            os.close(null)

    def isatty(self) -> bool:
        try:
            return self.broken is None and self.stream.isatty()
        except (OSError, ValueError):
            return False

    @property
    def buffer(self) -> Any:
        """The binary stream, unless this one degrades text to ASCII (writers that would bypass that, click's echo
        on an ASCII stream for one, then write the text here)."""
        if getattr(self.stream, "errors", None) == ASCII_FALLBACK:
            return None
        return getattr(self.stream, "buffer", None)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def _reopen_closed_descriptors() -> set[int]:
    """Open /dev/null on 0, 1 and 2 where they are closed, so no file the run opens takes their numbers (progress
    lines would land in metrics.jsonl); returns the ones that were closed."""
    closed = set()
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            closed.add(fd)
            null = os.open(os.devnull, os.O_RDWR)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
    return closed


def _ascii_safe(stream: Optional[TextIO]) -> None:
    """A stream whose encoding cannot write every character degrades to ASCII instead of raising."""
    encoding = (getattr(stream, "encoding", None) or "").lower().replace("_", "-")
    if stream is None or encoding.startswith("utf") or not isinstance(stream, io.TextIOWrapper):
        return
    with contextlib.suppress(Exception):
        stream.reconfigure(errors=ASCII_FALLBACK)


@contextlib.contextmanager
def guarded_streams() -> Iterator[None]:
    """While active, sys.stdout and sys.stderr are `GuardedStream`s (ASCII-safe); restored after."""
    closed = _reopen_closed_descriptors()
    saved = sys.stdout, sys.stderr
    for stream in saved:
        _ascii_safe(stream)
    if not isinstance(sys.stdout, GuardedStream):
        sys.stdout = GuardedStream(
            sys.stdout, "stdout", "stdout was closed when asyncpipe started" if 1 in closed else None
        )  # type: ignore[assignment]
    if not isinstance(sys.stderr, GuardedStream):
        sys.stderr = GuardedStream(
            sys.stderr, "stderr", "stderr was closed when asyncpipe started" if 2 in closed else None
        )  # type: ignore[assignment]
    try:
        yield
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        sys.stdout, sys.stderr = saved


def _guard_of(stream: Any) -> Optional[GuardedStream]:
    """The `GuardedStream` under `stream` (a tee such as train.log's wraps it in a ``stream`` attribute)."""
    for _ in range(8):
        if stream is None or isinstance(stream, GuardedStream):
            return stream
        stream = vars(stream).get("stream") if hasattr(stream, "__dict__") else None
    return None


def broken_streams() -> list[str]:
    """Why sys.stdout / sys.stderr no longer reach anyone (empty while both work)."""
    guards = (_guard_of(sys.stdout), _guard_of(sys.stderr))
    return [g.broken for g in guards if g is not None and g.broken]
