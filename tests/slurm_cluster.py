"""The test SLURM cluster (tests/slurm/cluster.sh): started once per session and shared by every SLURM test module
(`slurm_cluster` in conftest.py). It has two nodes where network namespaces can be made, so the multi-node tests
run on it too; single-node jobs run on either node. Where only one node is possible the multi-node tests skip.
Its daemons are detached: a `reaper` process stops them when the test process dies without its teardown (a
SIGTERM'd or SIGKILLed `make test`)."""

from __future__ import annotations

import contextlib
import os
import shlex
import subprocess
from pathlib import Path
from typing import Iterator, Optional

import pytest

CLUSTER = Path(__file__).resolve().parent / "slurm" / "cluster.sh"
SKIP = 77


def _up(root: Path, nodes: int) -> Optional[str]:
    """Start the cluster; None when it runs, else why it cannot run here (exit 77). Fails the test on an error."""
    args = [] if nodes == 1 else [str(nodes)]
    up = subprocess.run(["bash", str(CLUSTER), "up", str(root), *args], capture_output=True, text=True, timeout=600)
    if up.returncode == SKIP:
        return (up.stderr.strip().splitlines() or ["exit 77"])[-1]
    if up.returncode != 0:
        pytest.fail(f"tests/slurm/cluster.sh up DIR {' '.join(args)} failed:\n{up.stdout}\n{up.stderr}")
    return None


@contextlib.contextmanager
def client_env(**values: str) -> Iterator[None]:
    """``values`` in os.environ inside the block (sbatch exports the submitting environment to the jobs)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def reaper(root: Path, cluster: Path = CLUSTER) -> subprocess.Popen:
    """A process that runs `cluster.sh down ROOT` once this one dies, however it dies (a SIGTERM from `timeout` or
    CI, a SIGKILL): the daemons are detached, so nothing else would stop them. It waits for the end of a pipe only
    this process holds (not inherited: PEP 446), in a session of its own (a group kill does not take it along).
    `disarm` it on a normal teardown."""
    script = f"cat >/dev/null; exec bash {shlex.quote(str(cluster))} down {shlex.quote(str(root))}"
    return subprocess.Popen(["bash", "-c", script], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip


def disarm(watch: subprocess.Popen) -> None:
    watch.kill()  # before its pipe closes: it must not run `down` (the caller does, or nothing is up)
    watch.wait()
    assert watch.stdin is not None
    watch.stdin.close()


@contextlib.contextmanager
def running_cluster(root: Path, nodes: int = 1, fallback: bool = False) -> Iterator[Path]:
    """`cluster.sh up ROOT [NODES]` (``fallback``: one node where ``nodes`` cannot be made; a skip where no
    cluster is possible here), its clients' environment (SLURM_CONF, the cluster's bin/ first on PATH) while it
    runs, then `down`; a `reaper` brings it down if this process is killed first. DIR/cluster.env's NODES says how
    many nodes it has."""
    watch = reaper(root)  # armed before `up`: a kill during the start-up leaves nothing running either
    started, ran = True, False  # started: anything may be up (a failed `up` too); not after a skip (exit 77)
    try:
        why = _up(root, nodes)
        if why is not None and fallback and nodes > 1:
            why = _up(root, 1)
        if why is not None:
            started = False
            pytest.skip(f"no SLURM cluster: {why}")
        with client_env(SLURM_CONF=str(root / "slurm.conf"), PATH=f"{root / 'bin'}:{os.environ['PATH']}"):
            yield root
        ran = True
    finally:
        disarm(watch)
        if started:
            down = subprocess.run(["bash", str(CLUSTER), "down", str(root)], capture_output=True, text=True,
                                  timeout=120)  # fmt: skip
            assert down.returncode == 0 or not ran, down.stderr


def node_count(root: Path) -> int:
    for line in (root / "cluster.env").read_text().splitlines():
        if line.startswith("NODES="):
            return int(line.split("=", 1)[1])
    return 1
