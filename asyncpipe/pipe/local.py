"""Start the P x D rank processes of pipeline runs on this machine, torchrun-style (subprocesses with RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT), relay rank 0's step metrics and tear every rank down on failure.

Each rank runs ``python -m asyncpipe.pipe.local SPEC``; results and errors come back as files in a temporary
directory, so nothing depends on how the launcher itself was started.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

from omegaconf import DictConfig, OmegaConf

from asyncpipe.dist import destroy_process_group, free_port
from asyncpipe.errors import EXIT_INTERRUPTED, UserError


def _watch_parent() -> None:
    """Exit when the launching process dies, so a killed launcher never leaves ranks behind."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj))
    tmp.replace(path)


def _rank_main(spec_path: str) -> None:
    """One rank of `launch_many` (``python -m asyncpipe.pipe.local SPEC``): runs every job of the spec.

    Rank 0 appends one JSON line per step to ``events.jsonl``; each rank writes ``result-{job}-{rank}.json``
    per finished job, or ``error-{rank}.json`` and exits 1."""
    spec = json.loads(Path(spec_path).read_text())
    out = Path(spec["out"])
    rank = int(os.environ["RANK"])
    _watch_parent()
    from asyncpipe.train.signals import StopRequest

    # Installed before the heavy imports: a SIGTERM during start-up still ends in a checkpoint, not a crash.
    stop = StopRequest().__enter__()
    try:
        from asyncpipe.pipe.runner import run_pipeline

        with open(out / "events.jsonl", "a") if rank == 0 else open(os.devnull, "w") as events:

            def on_step(m: dict, job: int) -> None:
                events.write(json.dumps({"job": job, "metrics": m}) + "\n")
                events.flush()

            interrupted = False
            for i, job in enumerate(spec["jobs"]):
                if interrupted:  # a stop ends the launch: later jobs are reported, not run
                    skipped = {"status": "interrupted", "steps": 0, "exit_code": EXIT_INTERRUPTED}
                    _write_json(out / f"result-{i}-{rank}.json", skipped)
                    continue
                cfg = OmegaConf.create(job["config"])
                result = run_pipeline(cfg, job["run_dir"], on_step=lambda m, i=i: on_step(m, i), stop=stop)
                _write_json(out / f"result-{i}-{rank}.json", result)
                interrupted = result.get("status") == "interrupted"
        destroy_process_group()
    except BaseException as err:  # report, then die: the launcher tears the other ranks down
        kind = "user_error" if isinstance(err, UserError) else "error"
        text = str(err) if kind == "user_error" else traceback.format_exc()
        _write_json(out / f"error-{rank}.json", {"kind": kind, "text": text})
        if kind != "user_error":  # a user error is printed once, by the launcher
            sys.stderr.write(text + "\n")
            sys.stderr.flush()
        os._exit(1)


class _Forward:
    """While active (main thread only), SIGTERM / SIGUSR1 / SIGUSR2 sent to the launcher go to every rank, which
    checkpoint at the next agreed cut and finish as ``interrupted``; the launcher keeps waiting for them."""

    def __init__(self, procs: list) -> None:
        import signal

        from asyncpipe.train.signals import SIGNALS

        self.procs, self.previous = procs, {}
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self.previous[sig] = signal.signal(sig, self._relay)

    def _relay(self, signum: int, frame: Any) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signum)

    def __exit__(self, *exc: object) -> None:
        import signal

        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous = {}


def launch_many(
    cfgs: Sequence[DictConfig],
    run_dirs: Optional[Sequence[Optional[Union[str, os.PathLike]]]] = None,
    on_step: Optional[Callable[[int, dict], None]] = None,
    timeout_s: Optional[float] = None,
) -> list[dict]:
    """Run several pipeline configs of one world size back to back in one set of P x D local processes
    (process start and imports paid once); returns rank 0's result per config, in order.

    Ranks are subprocesses with torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT);
    ``on_step(job_index, metrics)`` is called here as rank 0 reports. Any failing rank stops them all."""
    if not cfgs:
        return []
    worlds = {c.pipeline.stages * c.pipeline.data_parallel for c in cfgs}
    if len(worlds) != 1:
        raise ValueError(f"configs of one launch must share stages x data_parallel, got worlds {sorted(worlds)}")
    world = worlds.pop()
    dirs = list(run_dirs) if run_dirs is not None else [None] * len(cfgs)
    # Prepare data here, once: a missing corpus is reported as a user error before any rank starts.
    from asyncpipe.data import ensure_prepared

    for c in cfgs:
        ensure_prepared(c.data, c.tokenizer)
    with tempfile.TemporaryDirectory(prefix="asyncpipe-launch-") as tmp:
        out = Path(tmp)
        jobs = [
            {"config": OmegaConf.to_container(c, resolve=True), "run_dir": None if d is None else str(d)}
            for c, d in zip(cfgs, dirs)
        ]
        spec = out / "spec.json"
        spec.write_text(json.dumps({"out": str(out), "jobs": jobs}))
        (out / "events.jsonl").touch()
        threads = max(c.pipeline.threads for c in cfgs)
        port = free_port()
        procs = []
        for r in range(world):
            env = dict(os.environ)
            env.update(
                RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(world),
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS=str(threads),
            )  # fmt: skip
            cmd = [sys.executable, "-m", "asyncpipe.pipe.local", str(spec)]
            procs.append(subprocess.Popen(cmd, env=env))
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        forwarding = _Forward(procs)
        try:
            with open(out / "events.jsonl") as events:

                def relay() -> None:
                    for line in events.readlines():
                        if on_step is not None and line.strip():
                            ev = json.loads(line)
                            on_step(ev["job"], ev["metrics"])

                def finished(r: int) -> bool:
                    return all((out / f"result-{i}-{r}.json").exists() for i in range(len(cfgs)))

                while True:
                    relay()
                    errors = sorted(out.glob("error-*.json"))
                    if errors:
                        err = json.loads(errors[0].read_text())
                        if err["kind"] == "user_error":
                            raise UserError(err["text"])
                        raise RuntimeError(f"pipeline {errors[0].stem} failed:\n{err['text']}")
                    if all(finished(r) for r in range(world)):
                        relay()
                        for proc in procs:  # every job is done; give the ranks a moment to tear down
                            try:
                                proc.wait(timeout=30)
                            except subprocess.TimeoutExpired:
                                pass
                        break
                    lost = [(r, p.poll()) for r, p in enumerate(procs) if p.poll() is not None and not finished(r)]
                    if lost:
                        time.sleep(0.5)  # a dying rank's error report may still be landing
                        if not list(out.glob("error-*.json")):
                            raise RuntimeError(f"pipeline rank {lost[0][0]} exited with code {lost[0][1]} mid-run")
                        continue
                    if deadline is not None and time.monotonic() > deadline:
                        raise TimeoutError(f"pipeline run did not finish within {timeout_s:.0f} s")
                    time.sleep(0.05)
        finally:
            forwarding.__exit__()
            for proc in procs:  # only our own children, by handle
                if proc.poll() is None:
                    proc.terminate()
            for proc in procs:
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        results = []
        for i in range(len(cfgs)):
            path = out / f"result-{i}-0.json"
            results.append(json.loads(path.read_text()) if path.exists() else {})
        return results


if __name__ == "__main__":
    _rank_main(sys.argv[1])
