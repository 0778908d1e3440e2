"""The trust table (issue 28): what asyncpipe reads from run dirs, sweep dirs and sweep files is untrusted input,
and a run's name and record mean what they say. Each case is one line on stderr naming the file or setting and
why, exit code 2, and an unchanged tree (the style of tests/test_bad_input_table.py, whose `_tree` and data root
this reuses). Classes: damaged run-dir files (a report of a run whose files cannot be trusted), damaged sweep
records, hostile or meaningless sweep files (the real sweep and its --dry-run refuse the same), nesting of runs,
sweeps and reports, and small refusals (empty data root, a seed no generator takes, --gpu-mem, traces).

The report of a sweep with one damaged run (the others reported, the damaged one named) is the last test.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import pandas as pd
import pytest
import yaml

from asyncpipe.cli import main
from test_bad_input_table import _tree, data_root  # noqa: F401 (a fixture)


@dataclass
class Case:
    argv: list[str]  # {tmp}: the test's scratch dir
    needle: str  # in the one error line
    setup: Optional[Callable[[Path], None]] = None
    env: dict = field(default_factory=dict)
    dry: bool = False  # also run with --dry-run: it must refuse the same


def run_dir(path: Path, config: Optional[dict] = None, summary: Optional[dict] = None) -> Path:
    """A small completed run's record: config.yaml, two metric lines, summary.json."""
    path.mkdir(parents=True, exist_ok=True)
    cfg = config or {"model": {"name": "tiny"}, "optimizer": {"name": "adamw", "ef": {"enabled": False}}, "delay": 0,
                     "engine": "simulate", "seed": 0}  # fmt: skip
    (path / "config.yaml").write_text(yaml.safe_dump(cfg))
    lines = [{"step": 1, "tokens": 100, "train_loss": 3.0, "val_loss": 3.1}, {"step": 2, "tokens": 200, "val_loss": 3.0}]
    (path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    summary = summary or {"status": "completed", "final_val_loss": 3.0, "tokens": 200, "wall_time": 1.0}
    (path / "summary.json").write_text(json.dumps(summary))
    return path


def damaged(file: str, content: "bytes | str | Callable[[Path], None]") -> Callable[[Path], None]:
    """Setup: a sweep {tmp}/sw whose only run `a` has `file` replaced by `content` (or made by it)."""

    def make(tmp: Path) -> None:
        run = run_dir(tmp / "sw" / "a")
        target = run / file
        target.unlink()
        if callable(content):
            content(target)
        else:
            target.write_bytes(content.encode() if isinstance(content, str) else content)

    return make


def fifo(path: Path) -> None:
    os.mkfifo(path)


def huge(path: Path) -> None:
    with open(path, "wb") as f:  # sparse: 600 MiB on paper, nothing on disk
        f.truncate(600 << 20)


BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{n}: &{n} [{', '.join(['*' + p] * 9)}]\n" for p, n in zip("abcdefg", "bcdefgh")
)


def sweep_file(text: str) -> Callable[[Path], None]:
    def make(tmp: Path) -> None:
        (tmp / "s.yaml").write_text(text)

    return make


def manifest(content: "str | Callable[[Path], None]") -> Callable[[Path], None]:
    def make(tmp: Path) -> None:
        sw = tmp / "sweeps" / "sw"
        sw.mkdir(parents=True)
        if callable(content):
            content(sw / "sweep.json")
        else:
            (sw / "sweep.json").write_text(content)

    return make


def completed_run_at(rel: str) -> Callable[[Path], None]:
    return lambda tmp: run_dir(tmp / rel)


def trace(files: dict[str, str], stages: int = 2) -> Callable[[Path], None]:
    def make(tmp: Path) -> None:
        run = tmp / "traced"
        run.mkdir()
        (run / "config.yaml").write_text(yaml.safe_dump({"pipeline": {"stages": stages}}))
        for name, text in files.items():
            (run / name).write_text(text)

    return make


def op(stage: int, name: str = "ForwardPass", start: float = 0.0, end: float = 1.0) -> dict:
    return {"stage": stage, "replica": 0, "op": name, "micro_batch": 0, "start": start, "end": end}


SWEEP = ["sweep", "--out", "{tmp}/sweeps"]
FILE = [*SWEEP, "--file", "{tmp}/s.yaml"]
REPORT = ["report", "{tmp}/sw", "--no-plots", "--no-wandb-log"]
TRACE = ["schedule", "--trace", "{tmp}/traced", "--out", "{tmp}/pictures"]

CASES: dict[str, Case] = {
    # -- a run dir's files are untrusted: the report of a sweep whose only run is damaged names file and reason
    "metrics.jsonl a FIFO": Case(REPORT, "metrics.jsonl is a FIFO, not a regular file", damaged("metrics.jsonl", fifo)),
    "summary.json a FIFO": Case(REPORT, "summary.json is a FIFO", damaged("summary.json", fifo)),
    "metrics.jsonl binary": Case(REPORT, "metrics.jsonl is not UTF-8 text", damaged("metrics.jsonl", b"\xff\xfe\x00x\n")),
    "config.yaml Latin-1": Case(REPORT, "config.yaml is not UTF-8 text", damaged("config.yaml", b"seed: 0 # caf\xe9\n")),
    "config.yaml a directory": Case(REPORT, "config.yaml is a directory", damaged("config.yaml", lambda p: p.mkdir())),
    "summary.json a directory": Case(REPORT, "summary.json is a directory", damaged("summary.json", lambda p: p.mkdir())),
    "config.yaml a device": Case(REPORT, "config.yaml is a character device",
                                 damaged("config.yaml", lambda p: p.symlink_to("/dev/zero"))),
    "metrics.jsonl 600 MiB": Case(REPORT, "metrics.jsonl is 600.0 MiB, above the 512 MiB", damaged("metrics.jsonl", huge)),
    "summary.json a list": Case(REPORT, "summary.json holds a JSON list, not an object", damaged("summary.json", "[1, 2]")),
    "summary.json torn": Case(REPORT, "summary.json is not valid JSON", damaged("summary.json", '{"status": "compl')),
    "summary tokens text": Case(REPORT, "tokens is 'abc', not a finite number",
                                damaged("summary.json", '{"status": "completed", "tokens": "abc"}')),
    "summary tokens 1e400": Case(REPORT, "tokens is 'inf', not a finite number",
                                 damaged("summary.json", '{"status": "completed", "tokens": 1e400}')),
    "summary val loss a list": Case(REPORT, "final_val_loss is '[3.0]'",
                                    damaged("summary.json", '{"status": "completed", "final_val_loss": [3.0]}')),
    "metrics line a list": Case(REPORT, "metrics.jsonl:1 holds a JSON list, not an object",
                                damaged("metrics.jsonl", '[1, 2]\n{"step": 1}\n')),
    "metrics line invalid": Case(REPORT, "metrics.jsonl:1 is not valid JSON", damaged("metrics.jsonl", '{"step": \n{}\n')),
    "metrics tokens NaN": Case(REPORT, "tokens is 'nan', not a finite number",
                               damaged("metrics.jsonl", '{"step": 1, "tokens": NaN, "val_loss": 3.0}\n')),
    "metrics val loss text": Case(REPORT, "val_loss is 'low', not a number",
                                  damaged("metrics.jsonl", '{"step": 1, "tokens": 5, "val_loss": "low"}\n')),
    "config.yaml alias bomb": Case(REPORT, "expands to more than 200,000 YAML nodes", damaged("config.yaml", BOMB)),
    "config.yaml a list": Case(REPORT, "config.yaml holds a YAML list, not a mapping", damaged("config.yaml", "- 1\n")),
    "config.yaml wrong type": Case(REPORT, "a setting has the wrong type", damaged("config.yaml", "delay: abc\n")),
    "resume with a FIFO config.yaml": Case(["train", "resume=true", "run.dir={tmp}/run"],
                                           "config.yaml is a FIFO, not a regular file; the run cannot be resumed",
                                           lambda tmp: ((tmp / "run").mkdir(), fifo(tmp / "run" / "config.yaml"))),
    "resume with an alias-bomb config.yaml": Case(["train", "resume=true", "run.dir={tmp}/run"],
                                                  "expands to more than 200,000 YAML nodes",
                                                  lambda tmp: ((tmp / "run").mkdir(),
                                                               (tmp / "run" / "config.yaml").write_text(BOMB))),
    "resume with a FIFO summary.json": Case(["train", "resume=true", "run.dir={tmp}/run"],
                                            "summary.json is not a readable run summary (is a FIFO",
                                            lambda tmp: ((tmp / "run").mkdir(), fifo(tmp / "run" / "summary.json"))),
    # -- a sweep's record (sweep.json): `sweep status` and a re-run say what is wrong in one line
    "sweep.json torn": Case(["sweep", "status", "{tmp}/sweeps/sw"], "sweep.json is not valid JSON", manifest('{"na')),
    "sweep.json a list": Case(["sweep", "status", "{tmp}/sweeps/sw"], "holds a JSON list", manifest("[]")),
    "sweep.json a FIFO": Case(["sweep", "status", "{tmp}/sweeps/sw"], "sweep.json is a FIFO", manifest(fifo)),
    "sweep.json a directory": Case(["sweep", "status", "{tmp}/sweeps/sw"], "sweep.json is a directory",
                                   manifest(lambda p: p.mkdir())),
    "sweep.json runs a dict": Case(["sweep", "status", "{tmp}/sweeps/sw"], "runs is a dict, not a list",
                                   manifest('{"runs": {}}')),
    "sweep.json dir escapes": Case(["sweep", "status", "{tmp}/sweeps/sw"], "not a directory name inside the sweep",
                                   manifest('{"runs": [{"name": "x", "dir": "../../etc"}]}')),
    "sweep.json run without dir": Case(["sweep", "status", "{tmp}/sweeps/sw"], "runs[0] is not a run entry",
                                       manifest('{"runs": [{"name": "x"}]}')),
    "re-run on a damaged sweep.json": Case([*SWEEP, "seed=0,1", "--name", "sw"], "sweep.json is not valid JSON",
                                           manifest('{"na'), dry=True),
    # -- sweep files: hostile ones refused quickly, and a run's name means what it says
    "sweep file alias bomb": Case(FILE, "expands to more than 200,000 YAML nodes", sweep_file(BOMB), dry=True),
    "sweep file above 1 MiB": Case(FILE, "above the 1 MiB", sweep_file("#" * (1 << 20) + "\n"), dry=True),
    "sweep file empty": Case(FILE, "s.yaml is empty", sweep_file(""), dry=True),
    "sweep file only a name": Case(FILE, "defines no runs", sweep_file("name: x\n"), dry=True),
    "sweep file a list": Case(FILE, "a sweep file is a mapping", sweep_file("- 1\n"), dry=True),
    "variants 1 and true": Case(FILE, "'1' and 'true' are the same key",
                                sweep_file("variants:\n  1: [delay=0]\n  true: [delay=1]\n"), dry=True),
    "variants 1 and 1.0": Case(FILE, "'1' and '1.0' are the same key",
                               sweep_file("variants:\n  1: [delay=0]\n  1.0: [delay=1]\n")),
    "per values 0 and false": Case(FILE, "'0' and 'false' are the same key",
                                   sweep_file("grid: {seed: [0]}\nper:\n  seed:\n    0: [delay=0]\n    false: [delay=1]\n")),
    "variant sets a grid key": Case(FILE, "'optimizer=muon' sets optimizer, a grid key",
                                    sweep_file("grid: {optimizer: [adamw, muon]}\nvariants: {a: [delay=0], b: [optimizer=muon]}\n"),
                                    dry=True),
    "variant sets a command-line grid key": Case([*FILE, "delay=0,1"], "'delay=1' sets delay, a grid key",
                                                 sweep_file("variants: {a: [delay=1]}\n"), dry=True),
    "per: entry sets the seed": Case(FILE, "'seed=7' sets the seed",
                                     sweep_file("grid: {optimizer: [adamw, muon], seed: [0]}\n"
                                                "per: {optimizer: {muon: [seed=7]}}\n"), dry=True),
    "variant sets the seed": Case(FILE, "'seed=1' sets the seed", sweep_file("variants: {a: [seed=1], b: [delay=1]}\n")),
    "variant sets a launcher key": Case(FILE, "launcher keys configure the whole sweep",
                                        sweep_file("variants: {a: [launcher.parallel=4], b: [delay=1]}\n"), dry=True),
    "per: entry sets a launcher key": Case(FILE, "launcher keys configure the whole sweep",
                                           sweep_file("grid: {seed: [0, 1]}\nper: {seed: {0: [launcher=slurm]}}\n")),
    "grid of 100,000": Case([*SWEEP, "seed=range(0,100000)"], "expands to 100,000 values, more than the 2,000", dry=True),
    "grid of 10**12": Case([*SWEEP, "seed=range(0,1000000000000)"], "expands to 1,000,000,000,000 values", dry=True),
    "grid product too large": Case([*SWEEP, "optimizer=adamw,muon", "delay=0,1", "seed=range(0,600)"],
                                   "the sweep has 2,400 runs (2 optimizer x 2 delay x 600 seed)", dry=True),
    "extension with other fixed overrides": Case([*SWEEP, "seed=0,1", "--name", "sw", "train.steps=3"],
                                                 "with other fixed overrides",
                                                 manifest('{"name": "sw", "base_overrides": ["train.steps=5"], '
                                                          '"grid": {"seed": ["0"]}, "runs": []}'), dry=True),  # fmt: skip
    # -- runs, sweeps and reports never nest
    "report --out in a run dir": Case(["report", "{tmp}/sw", "--out", "{tmp}/sw/a/rep"], "is inside run dir {tmp}/sw/a",
                                      completed_run_at("sw/a")),
    "report --out a run dir": Case(["report", "{tmp}/sw", "--out", "{tmp}/sw/a"], "--out {tmp}/sw/a is a run dir",
                                   completed_run_at("sw/a")),
    "sweep --out/--name a run dir": Case([*SWEEP, "seed=0,1", "--name", "r"], "{tmp}/sweeps/r is a run dir",
                                         completed_run_at("sweeps/r"), dry=True),
    "sweep --out inside a run dir": Case(["sweep", "seed=0,1", "--out", "{tmp}/r/sweeps"], "is inside run dir {tmp}/r",
                                         completed_run_at("r"), dry=True),
    "run.dir inside a run dir": Case(["train", "run.dir={tmp}/r/inner"], "run.dir={tmp}/r/inner is inside run dir {tmp}/r",
                                     completed_run_at("r")),
    "run.dir in a run's checkpoints": Case(["train", "run.dir={tmp}/r/checkpoints/x"], "is inside run dir {tmp}/r",
                                           lambda tmp: (run_dir(tmp / "r"), (tmp / "r" / "checkpoints").mkdir())),
    # -- small refusals, each before anything is written
    "empty ASYNCPIPE_DATA (train)": Case(["train", "run.dir={tmp}/run"], "the data root is empty", env={"ASYNCPIPE_DATA": ""}),
    "empty ASYNCPIPE_DATA (prepare)": Case(["data", "prepare"], "the data root is empty", env={"ASYNCPIPE_DATA": ""}),
    "100-digit seed": Case(["train", "seed=" + "9" * 100, "run.dir={tmp}/run"], "(100 digits) must be an integer in [0"),
    "negative seed": Case(["train", "seed=-1", "run.dir={tmp}/run"], "seed=-1 must be an integer in [0, 4294967295]"),
    "seed 2**32 in a sweep": Case([*SWEEP, "seed=0,4294967296"], "seed=4294967296 must be an integer", dry=True),
    "plan --gpu-mem inf": Case(["plan", "--gpu-mem", "inf"], "--gpu-mem inf must be a memory budget in GiB"),
    "plan --gpu-mem nan": Case(["plan", "--gpu-mem", "nan"], "--gpu-mem nan must be a memory budget"),
    "plan --gpu-mem 1e308": Case(["plan", "--gpu-mem", "1e308"], "--gpu-mem 1e+308 must be"),
    "plan --gpu-mem 0": Case(["plan", "--gpu-mem", "0"], "--gpu-mem 0 must be"),
    "plan --gpu-mem -8": Case(["plan", "--gpu-mem", "-8"], "--gpu-mem -8 must be"),
    "trace empty": Case(TRACE, "trace-rank0.json is not a trace asyncpipe wrote (empty)",
                        trace({"trace-rank0.json": "[]"})),
    "trace invalid": Case(TRACE, "trace-rank0.json is not a trace asyncpipe wrote (not valid JSON)",
                          trace({"trace-rank0.json": "[{"})),
    "trace an object": Case(TRACE, "(a JSON dict, not a list of ops)", trace({"trace-rank0.json": "{}"})),
    "trace without times": Case(TRACE, "entry 0 lacks an op name or finite start/end times",
                                trace({"trace-rank0.json": json.dumps([{"stage": 0, "op": "ForwardPass"}])})),
    "trace missing a stage": Case(TRACE, "the traces hold stages [0] but the run has 2 stage(s)",
                                  trace({"trace-rank0.json": json.dumps([op(0)])})),
    "trace of two runs": Case(TRACE, "two trace files hold stage 0",
                              trace({"trace-rank0.json": json.dumps([op(0)]), "trace-rank1.json": json.dumps([op(0)])})),
    "trace ends before it starts": Case(TRACE, "entry 0 ends before it starts",
                                        trace({"trace-rank0.json": json.dumps([op(0, start=2.0, end=1.0)])})),
    # -- issue 40: a real environment's slips, each one line before anything is written
    "RANK and WORLD_SIZE exported empty": Case(["train", "run.dir={tmp}/run"],
                                               "WORLD_SIZE='' in the environment must be an integer >= 1",
                                               env={"RANK": "", "WORLD_SIZE": ""}),
    "RANK beyond WORLD_SIZE": Case(["train", "run.dir={tmp}/run"], "RANK=2 must be below WORLD_SIZE=2",
                                   env={"RANK": "2", "WORLD_SIZE": "2"}),
    "run dir name with a newline": Case(["train", "run.dir='{tmp}/a\nb'"], "holds a control character ('\\n')"),
    "delay >= train.steps": Case(["train", "delay=30", "train.steps=5", "run.dir={tmp}/run"],
                                 "delay=30 with train.steps=5: every update would use gradients of the initial"),
    "delay >= train.steps in a sweep": Case([*SWEEP, "delay=1,5", "train.steps=5"],
                                            "run delay=5: delay=5 with train.steps=5: every update", dry=True),
    "deleted working directory": Case(["train", "train.steps=2", "run.dir={tmp}/run"],
                                      "the working directory ({tmp}/gone) no longer exists", lambda tmp: _gone(tmp)),
    "report --baseline of another length": Case(["report", "{tmp}/sw", "--baseline", "{tmp}/base", "--no-plots",
                                                 "--no-wandb-log"], "runs of other lengths make no gap", lambda tmp: (
        run_dir(tmp / "base" / "b", {**SYNC, "train": {"steps": 5}}),
        run_dir(tmp / "sw" / "a", {**SYNC, "train": {"steps": 10}}))),
    "sweep --name an existing file": Case([*SWEEP, "seed=0,1", "--name", "afile"],
                                          "sweep dir (--out/--name) {tmp}/sweeps/afile is a file",
                                          lambda tmp: ((tmp / "sweeps").mkdir(), (tmp / "sweeps" / "afile").write_text("x")),
                                          dry=True),
    "a sweep's run dir is a file": Case([*SWEEP, "seed=0,1", "--name", "sw"], "sw/seed=0 is a file where run seed=0 goes",
                                        lambda tmp: ((tmp / "sweeps" / "sw").mkdir(parents=True),
                                                     (tmp / "sweeps" / "sw" / "seed=0").write_text("x")), dry=True),
    "schedule 2bw with m < P": Case(["schedule", "--stages", "4", "--micro-batches", "2", "--out", "{tmp}/sched"],
                                    "--schedule 2bw needs --micro-batches >= --stages, got 2 < 4"),
    "bench pipeline 2BW with m < P": Case(["bench", "pipeline", "pipeline.stages=4", "train.micro_batches=2",
                                           "--out", "{tmp}/b.json"], "2BW needs train.micro_batches >= pipeline.stages"),
}

SYNC = {"model": {"name": "tiny"}, "optimizer": {"name": "adamw", "ef": {"enabled": False}}, "delay": 0,
        "engine": "simulate", "seed": 0}  # fmt: skip


def _gone(tmp: Path) -> None:
    """The shell's working directory deleted under it."""
    (tmp / "gone").mkdir()
    os.chdir(tmp / "gone")
    os.environ["PWD"] = str(tmp / "gone")  # the shell's record of it (restored by the test's monkeypatch)
    (tmp / "gone").rmdir()


@pytest.mark.parametrize("name", list(CASES))
def test_untrusted_input(name: str, tmp_path: Path, data_root: Path, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
                         capsys: pytest.CaptureFixture) -> None:  # fmt: skip
    case = CASES[name]
    fill = lambda s: s.replace("{tmp}", str(tmp_path))  # noqa: E731
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)  # default run dirs and an empty data root would land here
    monkeypatch.setenv("ASYNCPIPE_DATA", str(data_root))
    monkeypatch.setenv("PWD", str(work))
    for key, value in case.env.items():
        monkeypatch.setenv(key, fill(value))
    if case.setup:
        case.setup(tmp_path)
    before = _tree(tmp_path, data_root)
    for argv in [case.argv, *([[*case.argv, "--dry-run"]] if case.dry else [])]:
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_:
            main([fill(a) for a in argv])
        err = capsys.readouterr().err
        assert exit_.value.code == 2, err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), err
        assert fill(case.needle) in lines[0], lines[0]
        assert _tree(tmp_path, data_root) == before, "a refused command wrote files"


def test_budget_variant_may_set_train_steps(tmp_path: Path, data_root: Path, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
                                            capsys: pytest.CaptureFixture) -> None:  # fmt: skip
    """The budget grammar: a variant sets train.steps (a longer run of the same study) and the dry-run shows it."""
    monkeypatch.setenv("ASYNCPIPE_DATA", str(data_root))
    (tmp_path / "s.yaml").write_text("name: budget\ngrid: {optimizer: [adamw]}\noverrides: [train.steps=10]\n"
                                     "variants:\n  sync: [delay=0]\n  1-step+EF(x1.5): [delay=1, optimizer.ef.enabled=true, "
                                     "train.steps=15]\n")  # fmt: skip
    main_ok(["sweep", "--file", str(tmp_path / "s.yaml"), "--out", str(tmp_path / "sweeps"), "--dry-run"])
    out = capsys.readouterr().out
    assert "train.steps=15" in out and "2 runs" in out
    assert not (tmp_path / "sweeps").exists()


def main_ok(argv: list[str]) -> None:
    try:
        main(argv)
    except SystemExit as exit_:
        assert exit_.code in (0, None), exit_.code


def test_report_names_a_damaged_run_and_reports_the_others(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from asyncpipe.report.load import load_runs

    sw = tmp_path / "sw"
    for seed in range(3):
        cfg = {"model": {"name": "tiny"}, "optimizer": {"name": "adamw", "ef": {"enabled": False}}, "delay": 0,
               "engine": "simulate", "seed": seed}  # fmt: skip
        run_dir(sw / f"seed={seed}", cfg)
    os.unlink(sw / "seed=1" / "metrics.jsonl")
    os.mkfifo(sw / "seed=1" / "metrics.jsonl")  # would hang a reader that opened it blocking
    run_dir(sw / "seed=2" / "checkpoints" / "stray")  # a run dir inside another: named, not silently dropped

    loaded = load_runs(sw)
    assert sorted(loaded.runs["run"]) == ["seed=0", "seed=2"]
    assert loaded.found == 4 and loaded.read == 2
    reasons = {s.run: s.reason for s in loaded.skipped}
    assert "is a FIFO" in reasons["seed=1"] and "inside run dir seed=2" in reasons["seed=2/checkpoints/stray"]

    capsys.readouterr()
    main_ok(["report", str(sw), "--no-plots", "--no-wandb-log", "--out", str(tmp_path / "rep")])
    captured = capsys.readouterr()
    assert "found 4 run dir(s), read 2, skipped 2" in captured.err
    assert "skipped run seed=1: " in captured.err and "metrics.jsonl is a FIFO" in captured.err
    cells = pd.read_csv(tmp_path / "rep" / "gaps.csv")
    assert list(cells["n"]) == [2]  # the two readable runs are reported (one cell: adamw, sync)


def test_the_report_of_one_run_may_write_into_that_run(tmp_path: Path) -> None:
    """`report RUN` (default out RUN/report) is that run's own report; only another run's dir is refused."""
    from asyncpipe.errors import UserError
    from asyncpipe.report.load import load_runs

    run = run_dir(tmp_path / "r")
    other = run_dir(tmp_path / "o")
    assert list(load_runs(run, exclude=run / "report").runs["run"]) == ["r"]
    with pytest.raises(UserError, match="is inside run dir"):
        load_runs(run, exclude=other / "report")


def test_committed_records_may_store_their_curves_gzip_compressed_and_a_damaged_one_is_named(tmp_path):
    """results/ stores metrics.jsonl.gz: the report reads it as it reads metrics.jsonl (same losses), and a
    gzip file that is damaged or inflates past the cap is one named skip, not a traceback or a memory bomb."""
    import gzip as _gzip
    import shutil as _shutil

    from asyncpipe.report.load import load_runs
    from asyncpipe.track.files import UnreadableFile, read_untrusted_gz

    src = Path(__file__).resolve().parents[1] / "results" / "cpu_study" / "main"
    runs = sorted(p.parent for p in src.glob("optimizer=adamw,seed=*,variant=sync/summary.json"))[:2]
    plain, packed = tmp_path / "plain" / "s", tmp_path / "packed" / "s"
    for run in runs:  # the committed records are compressed: make a plain copy and a packed one of each
        _shutil.copytree(run, plain / run.name)
        _shutil.copytree(run, packed / run.name)
        gz = plain / run.name / "metrics.jsonl.gz"
        gz.with_name("metrics.jsonl").write_bytes(_gzip.decompress(gz.read_bytes()))
        gz.unlink()
    a, b = load_runs(plain), load_runs(packed)
    assert a.curves.equals(b.curves) and not b.skipped
    bad = packed / runs[1].name / "metrics.jsonl.gz"
    bad.write_bytes(b"\x1f\x8b not really gzip")
    loaded = load_runs(packed)
    assert [s.run for s in loaded.skipped] == [runs[1].name] and "gzip" in loaded.skipped[0].reason
    bomb = tmp_path / "bomb.gz"
    bomb.write_bytes(_gzip.compress(b"0" * (2 << 20)))
    with pytest.raises(UnreadableFile, match="inflates to more than"):
        read_untrusted_gz(bomb, max_bytes=1 << 20)
