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


def _sigterm_once(args: list[str], marker: str, log: Path, timeout: float) -> str:
    """Run ``asyncpipe ARGS``, send SIGTERM once ``marker`` is in its output; its output (exit 4, no traceback)."""
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "asyncpipe", *args], stdout=f, stderr=subprocess.STDOUT,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    deadline = time.time() + timeout
    while marker not in log.read_text() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
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
