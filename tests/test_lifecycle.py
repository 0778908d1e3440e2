"""One run lifecycle, two engines: the same matrix (summary fields and exit codes of a completed run, divergence,
a stop signal then an exact resume, a refused resume) through `asyncpipe train` for engine=simulate and
engine=pipeline (2 stages, 2BW). The pipeline's runs are multi-process, hence `slow`."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from helpers import asyncpipe, losses, read_metrics, read_summary, start, wait_for_step

STEPS, EVERY = 12, 4
COMMON = ["optimizer=adamw_ef", "delay=1", f"train.steps={STEPS}", f"train.eval_every={EVERY}",
          f"checkpoint.every={EVERY}", "train.micro_batch_size=4", "train.seq_len=32", "train.eval_batches=2",
          "precision=fp32", "device=cpu"]  # fmt: skip
ENGINES = {
    "simulate": ["engine=simulate"],
    "pipeline": ["engine=pipeline", "pipeline.stages=2", "train.micro_batches=2", "model.tie_embeddings=false"],
}
SUMMARY_KEYS = {"status", "final_val_loss", "tokens", "steps", "wall_time", "exit_code"}
ENGINE = pytest.mark.parametrize(
    "engine", ["simulate", pytest.param("pipeline", marks=[pytest.mark.slow, pytest.mark.timeout(400)])]
)


def _args(engine: str, run: Path, *extra: str) -> list[str]:
    return ["train", *COMMON, *ENGINES[engine], f"run.dir={run}", *extra]


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return {}


def _reference(references: dict, engine: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    if engine not in references:
        run = tmp_path_factory.mktemp("lifecycle") / f"reference-{engine}"
        proc = asyncpipe(*_args(engine, run))
        references[engine] = (run, proc)
    run, proc = references[engine]
    assert proc.returncode == 0, proc.stderr[-2000:]
    return run, proc.stdout


@ENGINE
def test_a_completed_run_has_the_same_record_for_both_engines(references, tmp_path_factory, engine: str) -> None:
    run, stdout = _reference(references, engine, tmp_path_factory)
    summary = read_summary(run)
    assert SUMMARY_KEYS <= set(summary)
    assert summary["status"] == "completed" and summary["exit_code"] == 0 and summary["steps"] == STEPS
    tokens_per_step = 4 * (4 if engine == "simulate" else 2) * 32  # micro_batch_size x micro_batches x seq_len
    assert summary["tokens"] == STEPS * tokens_per_step
    metrics = read_metrics(run)
    assert [m["step"] for m in metrics] == list(range(STEPS + 1))
    assert all(m["tokens"] == m["step"] * tokens_per_step for m in metrics)
    assert [m["step"] for m in metrics if "val_loss" in m] == list(range(0, STEPS + 1, EVERY))
    assert summary["final_val_loss"] == metrics[-1]["val_loss"]
    assert all(m["tokens_per_s"] > 0 for m in metrics[1:])
    assert f"step {STEPS}/{STEPS}" in stdout and f"completed: final val loss {summary['final_val_loss']}" in stdout
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert ckpts == [f"step_{4:08d}", f"step_{8:08d}"]  # every 4, keep 2, none at the end


@ENGINE
def test_divergence_ends_the_run_at_the_first_diverged_step(tmp_path: Path, engine: str) -> None:
    run = tmp_path / "div"
    proc = asyncpipe(*_args(engine, run, "train.diverge_loss=5.0"))
    assert proc.returncode == 3, proc.stderr[-2000:]
    summary = read_summary(run)
    assert summary["status"] == "diverged" and summary["exit_code"] == 3
    metrics = [m for m in read_metrics(run) if "train_loss" in m]
    assert metrics[-1]["train_loss"] > 5.0 and all(m["train_loss"] <= 5.0 for m in metrics[:-1])
    assert summary["steps"] == metrics[-1]["step"] < STEPS
    assert f"diverged at step {summary['steps']}" in proc.stdout


@ENGINE
def test_a_stop_signal_checkpoints_exits_4_and_resume_is_exact(references, tmp_path_factory, tmp_path: Path,
                                                               engine: str) -> None:  # fmt: skip
    reference, _ = _reference(references, engine, tmp_path_factory)
    run = tmp_path / "stopped"
    proc = start(*_args(engine, run), log=tmp_path / "log")
    wait_for_step(run, 2, proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=180) == 4, (tmp_path / "log").read_text()[-2000:]
    summary = read_summary(run)
    assert summary["status"] == "interrupted" and summary["exit_code"] == 4 and 2 <= summary["steps"] < STEPS
    ckpt = run / "checkpoints" / f"step_{summary['steps']:08d}"
    assert (ckpt / "COMPLETE").exists()
    done = asyncpipe(*_args(engine, run, "resume=true"))
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"resumed from {ckpt}" in done.stdout
    assert losses(run) == losses(reference)  # exact float equality, every step and every evaluation
    assert read_summary(run)["final_val_loss"] == read_summary(reference)["final_val_loss"]
    # issue 41: wall_time covers both segments (the stopped one's summary, then this one's)
    after = read_summary(run)
    assert after["wall_time"] == pytest.approx(summary["wall_time"] + after["wall_time_this_segment"])


@ENGINE
def test_a_refused_resume_is_one_line_exit_2_and_changes_nothing(references, tmp_path_factory, tmp_path: Path,
                                                                 engine: str) -> None:  # fmt: skip
    import shutil

    reference, _ = _reference(references, engine, tmp_path_factory)
    run = tmp_path / "unfinished"
    shutil.copytree(reference, run)
    (run / "summary.json").unlink()
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    proc = asyncpipe(*_args(engine, run, "resume=true", "seed=7"))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "seed was 0 when the run started, now 7" in lines[0], proc.stderr[-2000:]
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before
