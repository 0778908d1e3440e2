"""A stop signal during a bench: one line and exit 4, never a traceback, and no partial result file."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncpipe.bench.pipeline import check_jobs
from asyncpipe.errors import EXIT_INTERRUPTED, Stopped

DONE = {"status": "completed", "history": [{}] * 3}


def test_an_interrupted_job_is_a_stop_and_a_short_one_a_failure() -> None:
    with pytest.raises(Stopped, match=r"bench x stopped by a signal at job 2 \(2bw\), 1 of 3 jobs done; nothing written"):
        check_jobs("bench x", ["job 1 (1f1b)", "job 2 (2bw)", "job 3 (1f1b)"],
                   [DONE, {"status": "interrupted", "history": []}, {"status": "interrupted"}], 3)  # fmt: skip
    with pytest.raises(RuntimeError, match=r"job 1 \(1f1b\) ended completed after 1 of 3 steps"):
        check_jobs("bench x", ["job 1 (1f1b)"], [{"status": "completed", "history": [{}]}], 3)
    check_jobs("bench x", ["job 1 (1f1b)"], [DONE], 3)


def _sigterm_once(args: list[str], marker: "str | float", log: Path, timeout: float, env: dict = {}) -> str:
    """Run ``asyncpipe ARGS``, send SIGTERM once ``marker`` is in its output (a number: that many seconds after
    the start); its output (exit 4, no traceback)."""
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "asyncpipe", *args], stdout=f, stderr=subprocess.STDOUT,
                                env={**os.environ, "OMP_NUM_THREADS": "1", **env})  # fmt: skip
    deadline = time.time() + (marker if isinstance(marker, float) else timeout)
    waiting = lambda: isinstance(marker, float) or not _ready(proc.pid, marker, log)  # noqa: E731
    while waiting() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    assert proc.poll() is None, log.read_text()[-2000:]
    proc.send_signal(signal.SIGTERM)  # to the launcher: a pipeline bench relays the stop to its ranks
    assert proc.wait(timeout=120) == EXIT_INTERRUPTED, log.read_text()[-2000:]
    text = log.read_text()
    assert "Traceback" not in text, text[-2000:]
    return text


@pytest.mark.timeout(180)
def test_sigterm_during_a_bench_is_one_line_and_exit_4(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    args = ["bench", "pipeline", "model=tiny", "pipeline.stages=2", "train.micro_batches=2", "train.micro_batch_size=1",
            "train.seq_len=16", "--standin", "0.05,0.1", "--variants", "1f1b,2bw", "--rounds", "2", "--steps", "30",
            "--warmup-steps", "1", "--no-simulator", "--out", str(out)]  # fmt: skip
    text = _sigterm_once(args, "job 1 ", tmp_path / "log", 150)
    assert "stopped: bench pipeline stopped by a signal at job 1 (1f1b), 0 of 4 jobs done; nothing written" in text
    assert "(no run dir: nothing to resume)" in text and "resume=true" not in text  # a bench's jobs keep no run
    assert not out.exists()


@pytest.mark.timeout(120)
def test_sigterm_during_the_simulator_bench_is_one_line_and_exit_4(tmp_path: Path) -> None:
    # In-process: before, the signal's default action ended it with no word (exit 143).
    out = tmp_path / "sim.json"
    text = _sigterm_once(["bench", "simulator", "model=tiny", "--rounds", "500", "--out", str(out)], "round 1/",
                         tmp_path / "log", 100)  # fmt: skip
    assert "stopped: bench simulator stopped by SIGTERM in round " in text and "of 500; nothing written" in text
    assert not out.exists()


def _ready(pid: int, marker: str, log: Path) -> bool:
    """``marker`` is in the output; CAUGHT: the process has a handler for SIGTERM (its command has started)."""
    if marker != CAUGHT:
        return marker in log.read_text()
    caught = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("SigCgt"))
    return bool(int(caught.split()[1], 16) >> (signal.SIGTERM - 1) & 1)


CAUGHT = "a SIGTERM handler"
TINY_BENCH = ["bench", "pipeline", "model=tiny", "pipeline.stages=2", "train.micro_batches=2",
              "train.micro_batch_size=1", "train.seq_len=16", "--variants", "1f1b,2bw", "--rounds", "1", "--steps",
              "3", "--warmup-steps", "1", "--no-simulator"]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("when", [CAUGHT, "bench pipeline: model"], ids=["as its command starts", "as its ranks start"])
def test_sigterm_before_a_benchs_first_step_is_one_line_exit_4_and_no_launch_folder(tmp_path: Path, when) -> None:
    """The moment its command starts (before torch is imported and the config composed: about a second in) or
    while its ranks start: `stopped:`, exit 4, nothing written, and no `asyncpipe-launch-*` folder in TMPDIR."""
    tmp, out = tmp_path / "tmp", tmp_path / "bench.json"
    tmp.mkdir()
    text = _sigterm_once([*TINY_BENCH, "--out", str(out)], when, tmp_path / "log", 200, env={"TMPDIR": str(tmp)})
    assert "stopped: bench pipeline stopped by" in text and "nothing written" in text, text[-2000:]
    assert not out.exists() and not list(tmp.glob("asyncpipe-launch-*"))
