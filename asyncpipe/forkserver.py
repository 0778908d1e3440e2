"""Starting asyncpipe's own child processes without paying their imports every time.

A training process spends most of a short run importing: a 1-step `asyncpipe train` of the tiny model took 10.3 s
on a 2-core EPYC, 8.2 s of it in imports (torch 2.5 s, torch._dynamo 2.1 s, which torch.optim's first optimizer
imports). A sweep starts one such process per run and a pipeline run one per rank. `start` runs
``python -m asyncpipe ...`` and ``python -m asyncpipe.rank ...`` as forks of a fork server that has imported torch,
torch._dynamo, DeepSpeed and the trainer once for the process that starts them; any other command is an ordinary
`subprocess.Popen`. (Not ``multiprocessing``'s forkserver: its children re-import the starter's ``__main__``
script, which runs an unguarded script, such as a researcher's own, once more in every child.)

A forked child behaves as the fresh process would: it gets the given environment, working directory, standard
streams and extra file descriptors; its exit code, or the signal that ended it, is reported as Popen reports it; a
new session and a signal on the starter's death (Linux's parent-death signal) work for both kinds of child. The
starter's death is seen through a pipe, not through the parent pid: a forked child's parent is the fork server.
What a forked child does to become that process is `asyncpipe.forkchild`.

Preloading is off, and every child a fresh interpreter, on a machine with a GPU (a CUDA context does not survive a
fork, and the preloaded modules could create one) and where ``ASYNCPIPE_PRELOAD=0``.
"""

from __future__ import annotations

import glob
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import IO, Any, Optional, Sequence, Union

from asyncpipe.forkchild import become
from asyncpipe.runtime.signals import SIGNALS

# What a training process or a rank imports before its first step (torch._dynamo: the first optimizer's).
PRELOAD = [
    "torch",
    "torch._dynamo",
    "deepspeed",
    "omegaconf",
    "hydra",
    "asyncpipe.cli",
    "asyncpipe.run",
    "asyncpipe.trainer",
    "asyncpipe.engines.pipeline.deepspeed_engine",
]
MODULES = ("asyncpipe", "asyncpipe.rank")  # the `python -m` targets that start from the fork server
# Python's safe-path flag: the working directory is not put on the import path (a `yaml.py` or `random.py` left
# in the directory a sweep starts in must never run). PYTHONPATH still counts, unlike with -I.
SAFE_PATH = ("-P",) if sys.version_info >= (3, 11) else ()
Stream = Union[None, int, IO[Any]]
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the directory holding this asyncpipe
_MAX_MESSAGE = 1 << 20
SERVER_LOST = 255  # a child's exit code when its server died first (its real status is lost with the server)
_STOP_SIGNALS = SIGNALS  # the runs' stop signals (a closed terminal's SIGHUP among them)


def python_module(module: str, *args: str) -> list[str]:
    """argv of ``python -m module args`` that imports nothing from the working directory (``-P``; before Python
    3.11, which has no such flag, a ``-c`` that drops the working directory from the path and runs the module)."""
    if SAFE_PATH:
        return [sys.executable, *SAFE_PATH, "-m", module, *args]
    return [sys.executable, "-c", _RUN_MODULE, module, *args]


_RUN_MODULE = (
    "import runpy, sys; del sys.path[0]; sys.argv[:1] = []; "
    "runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)"
)


def _module_of(argv: Sequence[str]) -> tuple[Optional[str], bool, list[str]]:
    """(module, whether the working directory goes on its path, its arguments) of a ``python -m`` argv (also in
    `python_module`'s forms), else (None, False, [])."""
    if len(argv) > 2 and argv[0] == sys.executable and argv[1] == "-m":
        return argv[2], True, list(argv[3:])
    if len(argv) > 3 and argv[0] == sys.executable and list(argv[1:3]) in (["-P", "-m"], ["-c", _RUN_MODULE]):
        return argv[3], False, list(argv[4:])
    return None, False, []


def child_environ(env: Optional[dict] = None) -> dict[str, str]:
    """``env`` (default: this process's) for a `python_module` child, which must import this very asyncpipe: a
    checkout (perhaps found through the working directory) goes first on PYTHONPATH; an installed one needs nothing."""
    env = dict(os.environ if env is None else env)
    if os.path.exists(os.path.join(_ROOT, "pyproject.toml")):
        paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        if _ROOT not in paths:
            env["PYTHONPATH"] = os.pathsep.join([_ROOT, *paths])
    return env


def enabled() -> bool:
    """Whether children start from the fork server here (see the module docstring)."""
    if os.environ.get("ASYNCPIPE_PRELOAD", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    return not (glob.glob("/dev/nvidia[0-9]*") or os.path.exists("/dev/kfd"))


class _Server:
    """This process's connection to a fork server: the one it started on first use, or, in a child forked by a
    server, the connection that server gave it (so the ranks of a sweep's run fork from the sweep's server too).
    A server ends when its last client (its starter and every child of it still running) has closed its socket."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sock: Optional[socket.socket] = None
        self.proc: Optional[subprocess.Popen] = None

    def request(self, job: tuple, fds: list[int]) -> int:
        """Send one child's description and file descriptors; returns the forked child's pid."""
        with self.lock:
            if self.sock is None or (self.proc is not None and self.proc.poll() is not None):
                self._start()
            assert self.sock is not None
            socket.send_fds(self.sock, [pickle.dumps(job)], fds)
            reply = self.sock.recv(64)
            if not reply:
                raise OSError("the asyncpipe fork server ended")
            return int(reply)

    def _start(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    *SAFE_PATH,
                    "-c",
                    "import sys; sys.path[:1] = [] if sys.path[:1] == [''] else "
                    f"sys.path[:1]; sys.path.insert(0, {_ROOT!r}); "  # never the working directory; this asyncpipe
                    f"from asyncpipe.forkserver import serve; serve({theirs.fileno()})",
                ],
                stdin=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),),
            )
        self.sock = ours


_server = _Server()


def _running(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


class Child:
    """A child forked by the server, with the part of `subprocess.Popen`'s interface asyncpipe uses. Its exit
    status arrives on a pipe (the server, its parent, reaps it); ``alive_w`` is the pipe whose closing tells it
    that this process died."""

    def __init__(self, pid: int, status_r: int, alive_w: Optional[int]) -> None:
        self.pid, self._status_r, self._alive_w = pid, status_r, alive_w
        self._code: Optional[int] = None

    @property
    def returncode(self) -> Optional[int]:
        return self.poll()

    def poll(self) -> Optional[int]:
        return self._wait(0.0)

    def wait(self, timeout: Optional[float] = None) -> int:
        code = self._wait(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
        return code

    def _wait(self, timeout: Optional[float]) -> Optional[int]:
        if self._code is not None:
            return self._code
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._status_r >= 0 and select.select([self._status_r], [], [], timeout)[0]:
            data = os.read(self._status_r, 16)
            os.close(self._status_r)
            self._status_r = -1
            if data:
                self._finish(int(data))
        if self._code is None and self._status_r < 0:
            # The server died (no status came): the child is an orphan now; it ends when its pid does.
            while _running(self.pid):
                if deadline is not None and time.monotonic() >= deadline:
                    return None
                time.sleep(0.05)
            self._finish(SERVER_LOST)
        return self._code

    def _finish(self, code: int) -> None:
        self._code = code
        if self._alive_w is not None:
            os.close(self._alive_w)
            self._alive_w = None

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _fileno(stream: Stream, default: int) -> int:
    if stream is None:
        return default
    return stream if isinstance(stream, int) else stream.fileno()


def start(
    argv: Sequence[str],
    env: Optional[dict] = None,
    stdout: Stream = None,
    stderr: Stream = None,
    start_new_session: bool = False,
    pass_fds: Sequence[int] = (),
    parent_death_signal: Optional[int] = None,
) -> Union[Child, subprocess.Popen]:
    """Start ``argv`` like ``subprocess.Popen(argv, stdin=DEVNULL, ...)``; ``stderr=subprocess.STDOUT`` joins the
    two streams (a PIPE asks for a Popen). ``parent_death_signal``: the child gets this signal when the calling
    process dies."""
    argv = [str(a) for a in argv]
    env = dict(os.environ if env is None else env)
    module, cwd_first, args = _module_of(argv)
    if module in MODULES:
        env = child_environ(env)
    if module not in MODULES or not enabled() or subprocess.PIPE in (stdout, stderr):
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=stderr,
            env=env,
            pass_fds=tuple(pass_fds),
            start_new_session=start_new_session,
            preexec_fn=None if parent_death_signal is None else lambda: _set_parent_death_signal(parent_death_signal),
        )
    devnull = os.open(os.devnull, os.O_RDWR)
    status_r, status_w = os.pipe()
    alive_r, alive_w = os.pipe() if parent_death_signal is not None else (-1, None)
    try:
        out = devnull if stdout == subprocess.DEVNULL else _fileno(stdout, 1)
        err = out if stderr == subprocess.STDOUT else devnull if stderr == subprocess.DEVNULL else _fileno(stderr, 2)
        fds = [status_w, devnull, out, err, *pass_fds, *([alive_r] if alive_w is not None else [])]
        job = (module, args, env, os.getcwd(), cwd_first, list(pass_fds), start_new_session, parent_death_signal)
        pid = _server.request(job, fds)
    except BaseException:
        os.close(status_r)
        if alive_w is not None:
            os.close(alive_w)
        raise
    finally:
        for fd in (devnull, status_w, alive_r):
            if fd >= 0:
                os.close(fd)
    return Child(pid, status_r, alive_w)


def serve(fd: int) -> None:
    """The fork server: import `PRELOAD`, then fork one child per request until no client is left. Each child
    gets a connection of its own (its own children fork from here too); children are reaped here and their exit
    status written to each one's status pipe."""
    import importlib

    # A Ctrl-C or a group kill is for the runs, not for the server that reports their exit status.
    defaults = {sig: signal.signal(sig, signal.SIG_IGN) for sig in _STOP_SIGNALS}
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # servers run on machines without a GPU only (`enabled`)
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    clients = [socket.socket(fileno=fd)]
    status: dict[int, int] = {}  # child pid -> its status pipe
    while clients:
        for client in select.select(clients, [], [], 0.05)[0]:
            try:
                msg, fds, _flags, _addr = socket.recv_fds(client, _MAX_MESSAGE, 256)
            except OSError:
                msg, fds = b"", []
            if not msg:  # this client is gone; its children live on (each watches its starter itself)
                clients.remove(client)
                client.close()
                continue
            status_w, *child_fds = fds
            mine, childs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            pid = os.fork()
            if pid == 0:
                for other in (*clients, mine):
                    other.close()
                for other in (status_w, *status.values()):
                    os.close(other)
                for sig, handler in defaults.items():
                    signal.signal(sig, handler)
                _server.__init__()  # type: ignore[misc]
                _server.sock = childs
                become(*pickle.loads(msg), fds=child_fds)
            childs.close()
            for child_fd in child_fds:
                os.close(child_fd)
            clients.append(mine)
            status[pid] = status_w
            client.send(str(pid).encode())
        while status:
            try:
                pid, wstatus = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            w = status.pop(pid, None)
            if w is not None:
                try:
                    os.write(w, str(os.waitstatus_to_exitcode(wstatus)).encode())
                except OSError:  # the client is gone
                    pass
                os.close(w)


def _set_parent_death_signal(sig: int) -> None:
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG
    except Exception:  # not Linux: the caller's own clean-up still applies
        pass
