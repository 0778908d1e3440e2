"""The fork server's child side: a process just forked from `asyncpipe.forkserver`'s server becomes
``python [-P] -m module args`` (its environment, working directory, import path, standard streams and passed
descriptors as that fresh process would have them), runs the module and exits as that process would: with its exit
code, or by the signal that ended it. A starter that dies is seen through a pipe (its end of file)."""

from __future__ import annotations

import atexit
import fcntl
import io
import os
import runpy
import signal
import sys
import threading
import traceback
from typing import Optional


def _exit_code(err: SystemExit) -> int:
    if err.code is None:
        return 0
    if isinstance(err.code, int):
        return err.code & 0xFF
    print(err.code, file=sys.stderr)
    return 1


def become(
    module: str,
    args: list,
    env: dict,
    cwd: str,
    cwd_first: bool,
    pass_fds: list,
    new_session: bool,
    death_signal: Optional[int],
    fds: list,
) -> None:
    """In the forked child: become ``python [-P] -m module args`` and exit as that process would."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    # `python -m` puts the working directory first (`-P`: not at all), then PYTHONPATH (the server's sys.path,
    # which never holds its own working directory, came with the fork).
    extra = [p for p in dict.fromkeys(env.get("PYTHONPATH", "").split(os.pathsep)) if p and p not in sys.path]
    sys.path[:0] = [*([cwd] if cwd_first else []), *extra]
    stdin, out, err, *rest = fds
    for fd, target in ((stdin, 0), (out, 1), (err, 2)):
        os.dup2(fd, target)
    for fd in {stdin, out, err} - {0, 1, 2}:
        os.close(fd)
    # Passed descriptors keep their numbers, as Popen's pass_fds does (all moved out of the way first).
    above = max([2, *pass_fds, *rest]) + 1
    moved = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, above) for fd in rest]
    for fd in rest:
        os.close(fd)
    for fd, number in zip(moved, pass_fds):
        os.dup2(fd, number)  # inheritable, as a passed descriptor is
        os.close(fd)
    alive = moved[len(pass_fds)] if death_signal is not None else None
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    sys.stdin = open(0, closefd=False)
    sys.stdout = sys.__stdout__ = _text(1, line=os.isatty(1), unbuffered=unbuffered)  # type: ignore[misc]
    sys.stderr = sys.__stderr__ = _text(2, line=True, unbuffered=unbuffered)  # type: ignore[misc]
    threads = env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0 and "torch" in sys.modules:  # the OpenMP runtime read it at import
        sys.modules["torch"].set_num_threads(int(threads))
    if new_session:
        os.setsid()
    if death_signal is not None:
        threading.Thread(target=_signal_on_eof, args=(alive, death_signal), daemon=True).start()
    code = 0
    try:
        sys.argv = [module, *args]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exit_:
        code = _exit_code(exit_)
    except KeyboardInterrupt:  # as CPython does: the traceback, then die of SIGINT
        traceback.print_exc()
        code = -signal.SIGINT
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


def _text(fd: int, line: bool, unbuffered: bool) -> io.TextIOWrapper:
    raw = open(fd, "wb", buffering=0 if unbuffered else -1, closefd=False)
    return io.TextIOWrapper(
        raw,
        line_buffering=line and not unbuffered,
        write_through=unbuffered,
        errors="backslashreplace" if fd == 2 else "strict",
    )


def _signal_on_eof(fd: int, sig: int) -> None:
    """The starter holds the pipe's other end: end of file means it died."""
    while os.read(fd, 1):
        pass
    os.kill(os.getpid(), sig)
