"""Trust, round three (issue 40): what a real cluster login and job script do to a long run. A closed stdout, a
per-file size limit, an ASCII-only terminal, a deleted working directory, a start that fails before its first
step, a dead model, the umask, a large seed sweep's dry run, and a killed test run's SLURM daemons. (Signals and
closed pipes mid-run, and the checkpoint fallback, are in test_fault_tolerance.py; one-line refusals in
test_trust_table.py.)"""

from __future__ import annotations

import json
import os
import resource
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from asyncpipe.cli import main
from helpers import asyncpipe, cli_env, read_metrics, read_summary

TINY = ["train.micro_batch_size=4", "train.seq_len=32", "train.eval_batches=2"]


def _main(argv: list[str]) -> int:
    try:
        main(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    return 0


def _fresh(*args: str, env: dict, **kwargs) -> subprocess.CompletedProcess:
    """``python -m asyncpipe ARGS`` as a fresh interpreter (what the fork server cannot give: its standard
    streams or limits are set before Python starts)."""
    return subprocess.run([sys.executable, "-m", "asyncpipe", *args], env=env, capture_output=True, text=True,
                          timeout=300, **kwargs)  # fmt: skip


# -- standard streams --------------------------------------------------------------------------------------------
def test_stdout_closed_at_start_trains_and_notes_it_once_in_train_log(tmp_path: Path) -> None:
    """`asyncpipe train ... >&-` (as some schedulers start jobs): the run trains, train.log says stdout was closed."""
    run = tmp_path / "run"
    proc = _fresh("train", "train.steps=3", *TINY, f"run.dir={run}", env=cli_env(), preexec_fn=lambda: os.close(1))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert read_summary(run)["status"] == "completed"
    log = (run / "train.log").read_text()
    assert log.count("note: stdout was closed when asyncpipe started") == 1, log
    assert "step 3/3" in log and "completed: final val loss" in log  # the progress lines went to train.log


def _ascii_sweep(root: Path) -> Path:
    """A sweep of two seeds of sync and 1-step: its report prints ± and −; a run name holds ×."""
    from test_trust_table import run_dir

    sw = root / "sw"
    for seed in (0, 1):
        for delay in (0, 1):
            cfg = {"model": {"name": "tiny"}, "optimizer": {"name": "adamw", "ef": {"enabled": False}},
                   "delay": delay, "engine": "simulate", "seed": seed}  # fmt: skip
            run_dir(sw / f"seed={seed},delay={delay}", cfg, {"status": "completed", "final_val_loss": 3.0 + delay +
                                                               seed / 10, "tokens": 200, "wall_time": 1.0})  # fmt: skip
    runs = [{"name": p.name, "dir": p.name} for p in sorted(sw.iterdir())] + [{"name": "lr×2", "dir": "lr×2"}]
    (sw / "sweep.json").write_text(json.dumps({"name": "sw", "runs": runs}, ensure_ascii=False))
    return sw


def test_an_ascii_only_terminal_gets_ascii_from_report_and_sweep_status(tmp_path: Path) -> None:
    sw = _ascii_sweep(tmp_path)
    env = cli_env(LC_ALL="C", PYTHONIOENCODING="ascii")
    report = _fresh("report", str(sw), "--no-plots", "--no-wandb-log", "--out", str(tmp_path / "rep"), env=env)
    status = _fresh("sweep", "status", str(sw), env=env)
    for proc in (report, status):
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr and "UnicodeEncodeError" not in proc.stderr
        proc.stdout.encode("ascii")  # nothing but ASCII reached the terminal
    assert "+/-" in report.stdout  # ± degraded, not dropped
    assert "lrx2" in status.stdout
    assert "±" in (tmp_path / "rep" / "report.md").read_text(encoding="utf-8")  # files stay UTF-8


def test_a_deleted_working_directory_is_one_line_before_torch_is_imported(tmp_path: Path) -> None:
    gone = tmp_path / "gone"
    gone.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", "import os, sys, runpy; os.rmdir(os.getcwd()); "
                             "sys.argv = ['asyncpipe', 'train', 'train.steps=2', 'run.dir=/tmp/never']; "
                             "runpy.run_module('asyncpipe', run_name='__main__')"],
                            cwd=gone, env=cli_env(PWD=str(gone)), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "MKL" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and f"the working directory ({gone}) no longer exists" in lines[0], err


# -- a per-file size limit (ulimit -f) ----------------------------------------------------------------------------
@pytest.fixture
def file_limit():
    """Set this process's per-file size limit (bytes) for the test; restored after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # as Python's own start-up leaves it: EFBIG instead

    def limit(n: int | None) -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft if n is None else n, hard))

    yield limit
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    signal.signal(signal.SIGXFSZ, previous)


def _limited(file_limit, limit: int, argv: list[str], capsys) -> tuple[int, list[str]]:
    capsys.readouterr()
    file_limit(limit)
    try:
        code = _main(argv)
    finally:
        file_limit(None)
    return code, capsys.readouterr().err.strip().splitlines()


RUN = ["train.steps=8", "train.eval_every=4", "checkpoint.every=4", *TINY]


def test_write_failures_are_one_line_naming_the_file_and_what_continues(
        tmp_path: Path, file_limit, capsys, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.chdir(tmp_path)
    reference = tmp_path / "reference"
    assert _main(["train", *RUN, f"run.dir={reference}"]) == 0

    # a checkpoint save (a tiny model's part is ~0.9 MB): one line, no empty step dir, resume=true then continues
    run = tmp_path / "ckpt"
    code, err = _limited(file_limit, 200_000, ["train", *RUN, f"run.dir={run}"], capsys)
    assert code == 1 and len(err) == 1, err
    assert err[0].startswith(f"error: cannot write {run}/checkpoints/step_00000004/rank0.pt (File too large: the "
                             "per-file size limit (`ulimit -f`))"), err  # fmt: skip
    assert "re-run the command with resume=true" in err[0]
    assert not list((run / "checkpoints").iterdir())  # no empty step_00000004 left behind
    assert not list(run.glob("checkpoints/.*.tmp"))
    assert read_summary(run)["status"] == "failed"
    assert _main(["train", *RUN, f"run.dir={run}", "resume=true"]) == 0
    assert [m.get("train_loss") for m in read_metrics(run)] == [m.get("train_loss") for m in read_metrics(reference)]

    # metrics.jsonl mid-run
    run = tmp_path / "metrics"
    argv = ["train", *RUN, "train.steps=40", "checkpoint.every=0", f"run.dir={run}"]
    code, err = _limited(file_limit, 3_500, argv, capsys)  # above config.yaml (~2.7 KB)
    assert code == 1 and len(err) == 1 and err[0].startswith(f"error: cannot write {run}/metrics.jsonl (File too large")
    assert "resume=true" in err[0]

    # the first write of a fresh run (config.yaml, ~2 KB): nothing is kept, the same command is what to re-run
    run = tmp_path / "first"
    code, err = _limited(file_limit, 1_000, ["train", *RUN, f"run.dir={run}"], capsys)
    assert code == 1 and len(err) == 1 and err[0].startswith(f"error: cannot write {run}/config.yaml (File too large")
    assert "nothing was kept; re-run the same command" in err[0] and not run.exists()


def test_checkpoint_parts_follow_the_umask(tmp_path: Path) -> None:
    from asyncpipe.runtime import checkpoint

    old = os.umask(0o002)
    try:
        path = checkpoint.save(tmp_path, 4, {"x": 1}, {"model": "tiny"})
    finally:
        os.umask(old)
    for name in ("rank0.pt", "COMPLETE"):
        assert stat.S_IMODE((path / name).stat().st_mode) == 0o664, name  # group-readable and writable, not 0600


# -- a start that fails before its first step ---------------------------------------------------------------------
def test_a_start_that_failed_before_step_one_says_so_and_the_same_command_starts_afresh(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:  # fmt: skip
    import asyncpipe.trainer as trainer

    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    argv = ["train", "train.steps=3", *TINY, f"run.dir={run}"]

    def broken(*_args, **_kwargs):
        raise RuntimeError("a bug in the build")

    with monkeypatch.context() as patched:
        patched.setattr(trainer.Trainer, "__init__", broken)
        with pytest.raises(RuntimeError, match="a bug in the build"):
            main(argv)
    err = capsys.readouterr().err
    assert f"run dir {run} is kept: re-run the same command: the run never finished a step" in err
    assert (run / "config.yaml").exists()  # the half-made record ...
    assert _main(argv) == 0  # ... no longer blocks the same command
    assert "held a run that ended before its first step; nothing was trained, so it starts afresh" in \
        capsys.readouterr().out  # fmt: skip
    assert read_summary(run)["status"] == "completed"
    prov = json.loads((run / "provenance.json").read_text())
    assert "resumed" not in prov  # a fresh record, not a resume of the failed one
    assert _main(argv) == 2  # a run that trained is never overwritten


def test_an_out_of_package_method_declaring_key_without_config_is_one_line(tmp_path: Path) -> None:
    pkg = tmp_path / "mylab"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "bad.py").write_text(textwrap.dedent('''
        from asyncpipe.registry import declare_method

        @declare_method("bad_ef", buffers=1, fits_2bw=True, note="u", key="bad", needs_delay=True)
        def build(optimizer, cfg, delays):
            return optimizer
    '''))
    env = cli_env(PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    run = tmp_path / "run"
    proc = asyncpipe("train", "compensation._target_=mylab.bad", "delay=1", "train.steps=3", f"run.dir={run}", env=env)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "declare_method('bad_ef') has key= without config=" in lines[0]
    assert not run.exists()


# -- nonsense accepted no more ---------------------------------------------------------------------------------
def test_a_model_dead_at_the_uniform_guess_is_marked_diverged_not_completed(tmp_path: Path) -> None:
    """A huge lr kills the tiny model: train loss frozen at ln 256, gradient norm exactly 0. Not a result."""
    run = tmp_path / "dead"
    proc = asyncpipe("train", "train.steps=8", "optimizer.lr=1e4", "optimizer.weight_decay=0", *TINY, f"run.dir={run}")
    assert proc.returncode == 3, proc.stderr[-2000:]
    summary = read_summary(run)
    assert summary["status"] == "diverged" and summary["steps"] == 8
    assert "ln(vocab) = 5.5452 (the uniform guess)" in summary["collapsed"]
    tail = [m for m in read_metrics(run) if m["step"] >= 4]
    assert all(m["grad_norm"] == 0 for m in tail)  # what the rule saw


def test_a_500_seed_dry_run_composes_with_hydra_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`sweep 'seed=range(0,500)' --dry-run` took 106 s (0.2 s of Hydra per run): runs that differ only in seed and
    run dir now share one composition, and get the very config Hydra would have made."""
    import importlib

    from asyncpipe.config import to_yaml
    from asyncpipe.sweep.runner import dry_run_sweep

    compose_mod = importlib.import_module("asyncpipe.config.compose")  # (the package's `compose` hides the module)
    calls = []
    real = compose_mod.compose
    monkeypatch.setattr(compose_mod, "compose", lambda overrides, **kw: calls.append(1) or real(overrides, **kw))
    began = time.perf_counter()
    text = dry_run_sweep(["seed=range(0,500)", "model=tiny", "train.steps=2"], out=tmp_path / "sweeps")
    assert "500 runs" in text and len(calls) == 1
    assert time.perf_counter() - began < 60  # ~3 s of CPU on a 2-core EPYC; minutes before
    composer = compose_mod.Composer()
    for seed in (3, 7):
        over = [f"seed={seed}", "model=tiny", f"run.dir='{tmp_path}/s w/seed={seed}'", "tracker.wandb.group=g"]
        assert to_yaml(composer.compose(over)) == to_yaml(real(over))


def test_a_report_into_a_sweep_dir_it_cannot_write_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               capsys) -> None:  # fmt: skip
    sw = _ascii_sweep(tmp_path)
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: (not mode & os.W_OK) if Path(p) == sw else real_access(p, mode))
    capsys.readouterr()
    assert _main(["report", str(sw), "--no-plots", "--no-wandb-log"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and f"the report dir {sw}/report: cannot write to {sw} (permission denied)" in lines[0]
    assert not (sw / "report").exists()


def test_a_run_name_with_a_newline_or_pipe_keeps_its_table_row() -> None:
    import pandas as pd

    from asyncpipe.report.render import md_table

    text = md_table(pd.DataFrame({"val": ["3.0", "a|b"]}, index=["ok", "bad\nname"]))
    assert len(text.splitlines()) == 4 and "bad\\nname" in text and "a\\|b" in text


# -- a killed test run leaves no SLURM daemon -----------------------------------------------------------------
def test_the_slurm_reaper_runs_down_when_its_test_process_is_killed(tmp_path: Path) -> None:
    """tests/slurm_cluster.py's reaper, with a stand-in cluster.sh that records `down`: a pytest killed by SIGTERM
    (before any teardown) still gets its cluster stopped; a normal teardown disarms it."""
    fake = tmp_path / "cluster.sh"
    fake.write_text('echo "$1 $2" >> "$2/calls"\n')
    tests = Path(__file__).resolve().parent
    for kill in (True, False):
        root = tmp_path / ("killed" if kill else "clean")
        root.mkdir()
        code = (f"import os, signal, sys; sys.path.insert(0, {str(tests)!r}); from pathlib import Path; "
                f"import slurm_cluster as c; w = c.reaper(Path({str(root)!r}), Path({str(fake)!r})); "
                + ("os.kill(os.getpid(), signal.SIGTERM)" if kill else "c.disarm(w)"))  # fmt: skip
        proc = subprocess.run([sys.executable, "-c", code], env=cli_env(), timeout=60)
        assert proc.returncode == (-signal.SIGTERM if kill else 0)
        deadline = time.time() + 20
        while kill and not (root / "calls").exists() and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        calls = (root / "calls").read_text().split() if (root / "calls").exists() else []
        assert calls == (["down", str(root)] if kill else [])


def test_load_latest_passes_over_a_damaged_marker_or_part_but_refuses_another_runs(tmp_path: Path) -> None:
    from asyncpipe.errors import UserError
    from asyncpipe.runtime import checkpoint

    ours = {"model": "tiny", "seed": 0}
    for step in (4, 8, 12):
        checkpoint.save(tmp_path, step, {"x": step}, ours, keep=5)
    (tmp_path / "checkpoints/step_00000012/COMPLETE").write_text("{torn")
    part = tmp_path / "checkpoints/step_00000008/rank0.pt"
    part.write_bytes(part.read_bytes()[:200])
    said: list[str] = []
    path, state = checkpoint.load_latest(tmp_path, ours, log=said.append)
    assert path is not None and path.name == "step_00000004" and state == {"x": 4}
    assert [line.split(" cannot be used")[0] for line in said] == ["checkpoint step_00000012", "checkpoint step_00000008"]
    with pytest.raises(UserError, match="belongs to a different run"):
        checkpoint.load_latest(tmp_path, {**ours, "seed": 1}, log=said.append)
