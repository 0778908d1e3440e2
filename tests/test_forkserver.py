"""asyncpipe.forkserver: a child forked from the preloaded server behaves as the fresh `python -m` process would
(exit code or signal, streams, environment, working directory, passed descriptors), dies with its starter, and
never re-runs the starter's own script. The probe child is tests/forkserver_probe.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncpipe import forkserver
from helpers import cli_env

TESTS = Path(__file__).resolve().parent


@pytest.fixture
def probe(monkeypatch):
    monkeypatch.setattr(forkserver, "MODULES", (*forkserver.MODULES, "forkserver_probe"))
    return cli_env(PYTHONPATH=str(TESTS), PROBE="from the given env")


def _run(argv, env, cwd, tmp_path, name, fresh: bool):
    out, err = tmp_path / f"{name}.out", tmp_path / f"{name}.err"
    here = os.getcwd()
    os.chdir(cwd)
    try:
        with open(out, "wb") as o, open(err, "wb") as e:
            if fresh:
                proc = subprocess.Popen(argv, env=env, stdout=o, stderr=e, stdin=subprocess.DEVNULL)
            else:
                proc = forkserver.start(argv, env=env, stdout=o, stderr=e)
                assert isinstance(proc, forkserver.Child)
            code = proc.wait(timeout=120)
    finally:
        os.chdir(here)
    return code, out.read_text(), err.read_text()


@pytest.mark.parametrize("action,arg", [("report", "0"), ("report", "3"), ("raise", ""), ("exit-text", ""),
                                        ("signal", str(int(signal.SIGTERM)))])  # fmt: skip
def test_a_forked_child_exits_and_prints_as_a_fresh_process(probe, tmp_path, action, arg):
    argv = [sys.executable, "-m", "forkserver_probe", action, *([arg] if arg else [])]
    cwd = tmp_path / "somewhere"
    cwd.mkdir()
    forked = _run(argv, probe, cwd, tmp_path, "forked", fresh=False)
    fresh = _run(argv, probe, cwd, tmp_path, "fresh", fresh=True)
    assert forked[0] == fresh[0]
    if action == "report":
        seen, expected = json.loads(forked[1]), json.loads(fresh[1])
        assert seen.pop("pid") != expected.pop("pid")
        assert seen == expected
        assert seen["cwd"] == str(cwd) and seen["probe"] == "from the given env" and seen["stdin"] == ""
        assert forked[2] == fresh[2] == "a line on stderr\n"
    else:
        assert forked[1:] == fresh[1:] or action == "raise"
        if action == "raise":  # the same traceback, but for frames of the fork's own start-up
            assert forked[2].strip().splitlines()[-1] == fresh[2].strip().splitlines()[-1]
    assert fresh[0] == {"report": int(arg or 0), "raise": 1, "exit-text": 1, "signal": -signal.SIGTERM}[action]


def test_passed_descriptors_keep_their_number_and_stderr_can_join_stdout(probe, tmp_path):
    r, w = os.pipe()
    target = 57
    os.dup2(w, target)
    os.close(w)
    try:
        log = tmp_path / "log"
        with open(log, "wb") as out:
            proc = forkserver.start([sys.executable, "-m", "forkserver_probe", "write", str(target)], env=probe,
                                    stdout=out, stderr=subprocess.STDOUT, pass_fds=(target,))  # fmt: skip
        assert proc.wait(timeout=60) == 0
        os.close(target)
        assert os.read(r, 100) == b"through the passed descriptor"
        with open(log, "wb") as out:
            proc = forkserver.start([sys.executable, "-m", "forkserver_probe", "report", "0"], env=probe,
                                    stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
        assert proc.wait(timeout=60) == 0
        assert log.read_text().endswith("a line on stderr\n")
    finally:
        os.close(r)


def test_signals_timeouts_and_poll_behave_as_popens(probe):
    proc = forkserver.start([sys.executable, "-m", "forkserver_probe", "sleep", "30"], env=probe,
                            stdout=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    assert proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.2)
    assert os.getpgid(proc.pid) == proc.pid  # its own session and process group
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL
    assert proc.returncode == -signal.SIGKILL
    proc.kill()  # a finished child: nothing happens


STARTER = """
import sys
from pathlib import Path
from asyncpipe import forkserver
with open(sys.argv[1], "a") as marks:  # not guarded by __name__: a re-import would mark twice
    marks.write("ran\\n")
forkserver.MODULES = (*forkserver.MODULES, "forkserver_probe")
child = forkserver.start([sys.executable, "-m", "forkserver_probe", "sleep", "60"], parent_death_signal=9)
print(child.pid, flush=True)
import time; time.sleep(600)  # killed by the test; long, so a child slow to come up (a fresh venv's first imports
# under a loaded suite took over 60 s once) does not die with a starter that ended its wait first
"""


def test_a_child_dies_with_its_starter_and_the_starters_script_runs_once(tmp_path):
    script, marks = tmp_path / "starter.py", tmp_path / "marks"
    script.write_text(STARTER)
    starter = subprocess.Popen([sys.executable, str(script), str(marks)], stdout=subprocess.PIPE, text=True,
                               env=cli_env(PYTHONPATH=str(TESTS)))  # fmt: skip
    try:
        # The starter prints the child's pid, the child its own: two equal lines (whatever else an import printed).
        pids = []
        while len(pids) < 2:
            line = starter.stdout.readline()
            assert line, "the starter ended early"
            pids += [int(line)] if line.strip().isdigit() else []
        child = pids[0]
        assert pids[1] == child
        os.kill(starter.pid, signal.SIGKILL)
        starter.wait(timeout=30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and _alive(child):
            time.sleep(0.1)
        assert not _alive(child)
        assert marks.read_text() == "ran\n"
    finally:
        starter.kill()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_other_commands_and_a_switched_off_server_start_fresh_processes(probe, monkeypatch):
    proc = forkserver.start([sys.executable, "-c", "pass"])
    assert isinstance(proc, subprocess.Popen) and proc.wait(timeout=60) == 0
    monkeypatch.setenv("ASYNCPIPE_PRELOAD", "0")
    assert not forkserver.enabled()
    proc = forkserver.start([sys.executable, "-m", "forkserver_probe", "report", "0"], env=probe,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    assert isinstance(proc, subprocess.Popen) and proc.wait(timeout=60) == 0


def test_a_child_outliving_a_killed_server_is_running_until_it_ends(probe):
    proc = forkserver.start([sys.executable, "-m", "forkserver_probe", "sleep", "30"], env=probe,
                            stdout=subprocess.DEVNULL)  # fmt: skip
    server = forkserver._server.proc
    assert server is not None
    server.kill()
    server.wait(timeout=30)
    assert proc.poll() is None  # its status pipe ended with the server, but the child still runs
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=30) == forkserver.SERVER_LOST  # its real status went with the server
    again = forkserver.start([sys.executable, "-m", "forkserver_probe", "report", "0"], env=probe,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    assert again.wait(timeout=120) == 0  # a new server started
