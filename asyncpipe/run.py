"""The entry point of one training run (`asyncpipe train`): claim and record the run dir, then start the run's
`asyncpipe.trainer.Trainer` in the process layout the config and the environment ask for:

- one process (`engine=simulate`, `pipeline.data_parallel=1`): the trainer runs here;
- several (`engine=pipeline`, or simulate with `pipeline.data_parallel=D`): the local launcher starts them
  (`asyncpipe.spawn.launch`), every rank a trainer with the same resolved config (`python -m asyncpipe.rank`);
- under torchrun or SLURM (RANK / WORLD_SIZE set): this process is one rank; rank 0 claims the run dir.

Local files are the record: `config.yaml`, `metrics.jsonl`, `summary.json` (see `asyncpipe.session.rundir`).
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

from omegaconf import DictConfig

from asyncpipe import schedules
from asyncpipe.config.tuned import regime_warning
from asyncpipe.dist import destroy_process_group, rank_env
from asyncpipe.errors import UserError, WriteFailed
from asyncpipe.runtime.signals import StopRequest
from asyncpipe.session.rundir import RunRecord, never_stepped
from asyncpipe.spawn import Job, RankFailed, launch, world_of
from asyncpipe.status import FAILED, exit_code
from asyncpipe.track.provenance import recorded
from asyncpipe.trainer import train


def compose_run(overrides: Sequence[str]) -> DictConfig:
    """`asyncpipe train`'s config in one call: composed and validated (`config.compose`), its delay below its
    train.steps (`config.validate.check_delay_fits`), its run dir and (when the data still has to be prepared) its
    data root checked before anything is written (`asyncpipe.paths`)."""
    from asyncpipe.config import compose
    from asyncpipe.config.validate import check_delay_fits
    from asyncpipe.data import dataset_dir
    from asyncpipe.paths import data_root, own_dir
    from asyncpipe.plan import budgeted

    cfg = budgeted(compose(list(overrides)))  # a cut within pipeline.memory_gib: chosen once, recorded as a list
    check_delay_fits(cfg)
    own_dir(cfg.run.dir, "run.dir")
    data_root(cfg.data.root, prepared=(dataset_dir(cfg.data, cfg.tokenizer) / "manifest.json").is_file())
    return cfg


@contextlib.contextmanager
def _claimed(cfg: DictConfig, overrides: Sequence[str], rank: int) -> Iterator[Optional[RunRecord]]:
    """Rank 0 claims the run dir (`RunRecord`, provenance.json, train.log) for the run's life and releases it
    after; a user mistake removes what a refused run created. Other ranks get None."""
    revisions = schedules.revisions(cfg) if rank == 0 else None  # the rules' revisions it runs, for provenance.json
    with recorded(cfg, overrides, rank=rank, revisions=revisions):  # provenance.json, train.log: after config.yaml
        try:
            record = RunRecord.open(cfg) if rank == 0 else None
        except WriteFailed as err:  # its first write: nothing of the run was kept
            err.then = "nothing was kept; re-run the same command once the file can be written"
            raise
        if record is not None and record.note:
            print(record.note, flush=True)
        try:
            yield record
        except UserError:
            if record is not None:
                record.close(failed_by_user=True)
            raise
        except BaseException as err:
            if record is not None:
                record.close()
                how = _what_is_left(record.path)
                if isinstance(err, WriteFailed):  # one line: the file, why, and what continues
                    err.then = f"free space or raise the limit, then {how}"
                else:
                    print(f"the run failed; run dir {record.path} is kept: {how}", file=sys.stderr, flush=True)
            raise
        if record is not None:
            record.close()


def _what_is_left(path: Path) -> str:
    """After a failure: whether the run dir is resumed, or (nothing trained) started afresh by the same command."""
    if never_stepped(path):
        return "re-run the same command: the run never finished a step, so it starts afresh"
    if any(Path(path).glob("checkpoints/step_*/COMPLETE")):
        return "re-run the command with resume=true to continue from the latest checkpoint"
    return "re-run the command with resume=true (no checkpoint was written yet: it starts again from step 0)"


def _launched(cfg: DictConfig, path: Path, stop: StopRequest) -> dict:
    """The run's ranks on this machine, through the local launcher; a failed rank is a failed run."""
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
        rank, world = (env[0], env[1]) if env is not None and env[1] > 1 else (0, 1)
        if world > 1 and world != world_of(cfg):
            raise UserError(
                f"launched as {world} processes but the config needs {world_of(cfg)} "
                f"(pipeline.stages x pipeline.data_parallel for engine=pipeline, pipeline.data_parallel for simulate)"
            )
        with _claimed(cfg, overrides, rank) as record:
            warning = regime_warning(cfg) if rank == 0 else None
            if warning:  # once the run is accepted, in its log: a default lr tuned for another regime
                log(warning)
            if world > 1:  # one rank of a job started by torchrun or SLURM
                summary = train(cfg, Path(cfg.run.dir), log=log if rank == 0 else (lambda _: None), stop=stop)
                destroy_process_group()  # after a success only: with a rank gone, its barrier would wait forever
            elif world_of(cfg) == 1:
                assert record is not None
                summary = train(cfg, record.path, log=log, stop=stop)
            else:
                assert record is not None
                summary = _launched(cfg, record.path, stop)
    return {k: v for k, v in summary.items() if k != "history"}
