"""One rank started by the local launcher (``python -m asyncpipe.rank SPEC``, see `asyncpipe.spawn`): runs the spec's
jobs back to back, each through its `asyncpipe.trainer.Trainer`, and reports through files.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any, Iterator, Optional

from asyncpipe.errors import UserError
from asyncpipe.runtime.signals import StopRequest
from asyncpipe.status import INTERRUPTED, exit_code
from asyncpipe.terminal import guarded_streams


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj))  # NaN stays NaN: results are read back by Python only
    tmp.replace(path)


@contextlib.contextmanager
def _train_log(run_dir: Optional[Path]) -> Iterator[None]:
    """Rank 0's progress lines go to the run's train.log too (the launcher's own lines are teed there by it)."""
    if run_dir is None:
        yield
        return
    from asyncpipe.track.provenance import LogTee

    tee = LogTee(sys.stdout, run_dir)
    tee.started = 0.0  # the launcher claimed the run dir (config.yaml) before this rank started
    sys.stdout = tee  # type: ignore[assignment]
    try:
        yield
    finally:
        sys.stdout = tee.stream
        tee.log_only(*([tee.partial] if tee.partial.strip() else []))


def main(spec_path: str) -> None:
    """Run every job of the spec; rank 0 appends one JSON line per step to ``events.jsonl``. Each rank writes
    ``result-{job}-{rank}.json`` per finished job, or ``error-{rank}.json`` and exits 1."""
    # Installed before the heavy imports: a stop signal during start-up still ends in a summary, not a crash.
    stop = StopRequest().__enter__()
    guarded_streams().__enter__()  # a closed or broken stdout never ends the rank (the process ends with the jobs)
    spec = json.loads(Path(spec_path).read_text())
    if spec.get("stopped"):
        stop.signal_name = spec["stopped"]
    out = Path(spec["out"])
    rank = int(os.environ["RANK"])
    try:
        from omegaconf import OmegaConf

        from asyncpipe.dist import destroy_process_group, job_groups
        from asyncpipe.trainer import train

        with open(out / "events.jsonl", "a") if rank == 0 else open(os.devnull, "w") as events:

            def on_step(m: dict, job: int) -> None:
                events.write(json.dumps({"job": job, "metrics": m}) + "\n")
                events.flush()

            interrupted = False
            for i, job in enumerate(spec["jobs"]):
                if interrupted:  # a stop ends the launch: later jobs are reported, not run
                    skipped = {"status": INTERRUPTED, "steps": 0, "exit_code": exit_code(INTERRUPTED)}
                    _write_json(out / f"result-{i}-{rank}.json", skipped)
                    continue
                run_dir = None if job["run_dir"] is None else Path(job["run_dir"])
                with _train_log(run_dir if rank == 0 else None), job_groups():
                    result = train(
                        OmegaConf.create(job["config"]),
                        run_dir,
                        stop=stop,
                        on_step=lambda m, i=i: on_step(m, i),
                        show_progress=job["show_progress"],
                    )
                _write_json(out / f"result-{i}-{rank}.json", result)
                interrupted = result.get("status") == INTERRUPTED
        destroy_process_group()
    except BaseException as err:  # report, then die: the launcher tears the other ranks down
        kind = "user_error" if isinstance(err, UserError) else "error"
        text = str(err) if kind == "user_error" else traceback.format_exc()
        _write_json(out / f"error-{rank}.json", {"kind": kind, "text": text})
        if kind != "user_error":  # a user error is printed once, by the launcher
            sys.stderr.write(text + "\n")
            sys.stderr.flush()
        os._exit(1)


if __name__ == "__main__":
    main(sys.argv[1])
