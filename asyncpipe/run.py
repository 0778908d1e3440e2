"""The entry point of one training run (`asyncpipe train`): claim and record the run dir, pick the process layout,
run the ranks.

- one process (`engine=simulate`, `pipeline.data_parallel=1`): the run trains here (`asyncpipe.rank.run_rank`);
- several (`engine=pipeline`, or simulate with `pipeline.data_parallel=D`): the local launcher starts them
  (`asyncpipe.spawn.launch`), every rank with the same resolved config;
- under torchrun or SLURM (RANK / WORLD_SIZE set): this process is one rank; rank 0 claims the run dir.

Local files are the record: `config.yaml`, `metrics.jsonl`, `summary.json` (see `asyncpipe.session.rundir`).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable, Optional, Sequence

from omegaconf import DictConfig

from asyncpipe.dist import rank_env
from asyncpipe.errors import UserError
from asyncpipe.rank import run_rank
from asyncpipe.runtime.signals import StopRequest
from asyncpipe.session.rundir import RunRecord
from asyncpipe.spawn import Job, RankFailed, launch, world_of
from asyncpipe.status import FAILED, exit_code
from asyncpipe.track.provenance import recorded


def _one_of_many(cfg: DictConfig, log: Callable[[str], None], stop: StopRequest, overrides: Sequence[str]) -> dict:
    """This process is one rank of a job started by torchrun or SLURM; rank 0 claims and writes the run dir."""
    from asyncpipe.dist import destroy_process_group

    env = rank_env()
    assert env is not None
    rank, world, _ = env
    if world != world_of(cfg):
        raise UserError(
            f"launched as {world} processes but the config needs {world_of(cfg)} "
            f"(pipeline.stages x pipeline.data_parallel for engine=pipeline, pipeline.data_parallel for simulate)"
        )
    with recorded(cfg, overrides, rank=rank):  # provenance.json, train.log: once this run wrote config.yaml
        record = RunRecord.open(cfg) if rank == 0 else None
        try:
            summary = run_rank(cfg, Path(cfg.run.dir), log=log if rank == 0 else (lambda _: None), stop=stop)
        except UserError:
            if record is not None:
                record.close(failed_by_user=True)
            raise
        destroy_process_group()  # after a success only: with a rank gone, the teardown's barrier would wait forever
        if record is not None:
            record.close()
    return summary


def _here(cfg: DictConfig, path: Path, log: Callable[[str], None], stop: StopRequest) -> dict:
    if world_of(cfg) == 1:
        return run_rank(cfg, path, log=log, stop=stop)
    try:
        (result,) = launch([Job(cfg, path)], stopped=stop.signal_name)
    except RankFailed as err:
        print(f"error: {err}", file=sys.stderr)
        return {"status": FAILED, "exit_code": exit_code(FAILED)}
    return result


def run_training(cfg: DictConfig, log: Optional[Callable[[str], None]] = None, overrides: Sequence[str] = ()) -> dict:
    """Run one training job as configured; returns its summary (``exit_code`` included). ``overrides``: the
    command line as the user typed it, for the run's provenance.json only (every rank trains ``cfg``)."""
    log = log or print
    with StopRequest() as stop:  # from here on a stop signal ends the run with a summary, never a bare kill
        env = rank_env()
        if env is not None and env[1] > 1:
            summary = _one_of_many(cfg, log, stop, overrides)
        else:
            with recorded(cfg, overrides, rank=0):  # provenance.json, train.log: once this run wrote config.yaml
                record = RunRecord.open(cfg)
                try:
                    summary = _here(cfg, record.path, log, stop)
                except UserError:
                    record.close(failed_by_user=True)
                    raise
                except BaseException:
                    record.close()
                    raise
                record.close()
    return {k: v for k, v in summary.items() if k != "history"}
