"""The bad-input table: every user mistake is one line on stderr naming the bad key or path, exit code 2, and
nothing written (no run dir, no data, no half-made report or schedule file).

Each case runs the real entry point `asyncpipe.cli.main` in this process (argv in, exit code and stderr out),
in a fresh working directory, with a prepared data root; the whole tree under the test's tmp dir and the data
root are compared before and after. `tests/test_bad_input.py` keeps the cases that need a subprocess.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import pytest

from asyncpipe.cli import main

READ_ONLY = "/proc/sys"  # not writable, even by root (Linux)


@dataclass
class Case:
    argv: list[str]  # {tmp}: the test's scratch dir; {ro}: a directory nobody may write to
    needle: str  # in the one error line (same placeholders)
    setup: Optional[Callable[[Path], None]] = None
    env: dict = field(default_factory=dict)


def afile(tmp: Path) -> None:
    (tmp / "afile").write_text("not a directory\n")


def corrupt_run(tmp: Path, text: str = '{"status": "interr') -> None:
    run = tmp / "run"
    run.mkdir()
    (run / "config.yaml").write_text("seed: 0\n")
    (run / "summary.json").write_text(text)


def corrupt_sweep_run(tmp: Path) -> None:
    run = tmp / "sweeps" / "sw" / "seed=0"
    run.mkdir(parents=True)
    (run / "summary.json").write_text('{"status": "compl')


def bad_sweep_file(tmp: Path) -> None:
    (tmp / "bad.yaml").write_text("name: bad\ngrid: {seed: '0,1'}\nvariants: {a: [delay=1], b: ['delay=0,1']}\n")


def bad_profile(tmp: Path, line: str) -> None:
    """The shipped device profile with one line replaced (``key: value``)."""
    from asyncpipe.timelines.cost_source import PROFILE_DIR

    key = line.split(":")[0]
    text = (PROFILE_DIR / "h100_assumed.yaml").read_text().splitlines()
    (tmp / "p.yaml").write_text("\n".join(line if t.startswith(f"{key}:") else t for t in text) + "\n")


def train(*overrides: str) -> list[str]:
    """`asyncpipe train` with these overrides, in the scratch dir unless they set run.dir."""
    run_dir = [] if any(o.startswith("run.dir=") for o in overrides) else ["run.dir={tmp}/run"]
    return ["train", *overrides, *run_dir]


SCHED = ["schedule", "--out", "{tmp}/sched"]

CASES: dict[str, Case] = {
    # -- optimizer values: today a torch traceback after the run dir is made, or silently trained
    "betas one value": Case(train("optimizer.betas=[0.9]"), "optimizer.betas=[0.9] needs two values"),
    "betas three values": Case(train("optimizer.betas=[0.9,0.95,0.99]"), "optimizer.betas="),
    "beta1 above 1": Case(train("optimizer.betas=[1.5,0.95]"), "beta1=1.5 must be in [0, 1)"),
    "beta2 negative": Case(train("optimizer.betas=[0.9,-0.1]"), "beta2=-0.1 must be in [0, 1)"),
    "beta2 = 1": Case(train("optimizer=nadam", "optimizer.betas=[0.9,1.0]"), "beta2=1.0 must be in [0, 1)"),
    "eps negative": Case(train("optimizer.eps=-1"), "optimizer.eps=-1.0 must be > 0"),
    "eps zero": Case(train("optimizer.eps=0"), "optimizer.eps=0.0 must be > 0"),
    "lr inf": Case(train("optimizer.lr=inf"), "optimizer.lr=inf must be a finite number"),
    "lr nan": Case(train("optimizer.lr=nan"), "optimizer.lr=nan must be a finite number"),
    "lr negative": Case(train("optimizer.lr=-1e-3"), "optimizer.lr=-0.001 must be > 0"),
    "lr zero": Case(train("optimizer.lr=0"), "optimizer.lr=0.0 must be > 0"),
    "aux lr negative": Case(train("optimizer=muon", "optimizer.aux_lr=-1"), "optimizer.aux_lr=-1.0 must be > 0"),
    "muon momentum 2": Case(train("optimizer=muon", "optimizer.momentum=2"), "optimizer.momentum=2.0 must be in [0, 1)"),
    "muon momentum negative": Case(train("optimizer=muon", "optimizer.momentum=-0.5"), "optimizer.momentum=-0.5"),
    "muon ns_steps 0": Case(train("optimizer=muon", "optimizer.ns_steps=0"), "optimizer.ns_steps=0 must be >= 1"),
    "nadam momentum_decay negative": Case(train("optimizer=nadam", "optimizer.momentum_decay=-1"), "optimizer.momentum_decay=-1.0"),
    "weight decay negative": Case(train("optimizer.weight_decay=-0.1"), "optimizer.weight_decay=-0.1 must be >= 0"),
    "EF lam negative": Case(train("optimizer=adamw_ef", "optimizer.ef.lam=-1"), "compensation.ef.lam=-1.0 must be >= 0 (optimizer.ef.lam is its alias)"),
    # -- other values
    "diverge_loss negative": Case(train("train.diverge_loss=-1"), "train.diverge_loss=-1.0 must be > 0"),
    "diverge_loss nan": Case(train("train.diverge_loss=nan"), "train.diverge_loss=nan must be a finite number"),
    "launcher.parallel 0 (train)": Case(train("launcher.parallel=0"), "launcher.parallel=0 must be >= 1"),
    "launcher.parallel 0 (sweep)": Case(["sweep", "seed=0,1", "launcher.parallel=0", "--out", "{tmp}/sweeps"],
                                        "launcher.parallel=0 must be >= 1"),
    "slurm timeout 0": Case(["sweep", "seed=0,1", "launcher=slurm", "launcher.timeout_min=0", "--out", "{tmp}/sweeps"],
                            "launcher.timeout_min=0 must be >= 1"),
    "negative delay": Case(train("delay=-1"), "delay=-1 must be >= 0"),
    "steps 0": Case(train("train.steps=0"), "train.steps=0 must be >= 1"),
    "warmup_frac 1": Case(train("train.warmup_frac=1"), "train.warmup_frac=1.0 must be in [0, 1)"),
    "lr_schedule unknown": Case(train("train.lr_schedule=linear"), "train.lr_schedule=linear is not allowed"),
    "wsd without warmup_steps": Case(train("train.lr_schedule=wsd"), "train.lr_schedule=wsd needs train.warmup_steps"),
    "wsd warm-up into the decay": Case(train("train.lr_schedule=wsd", "train.warmup_steps=90"),
                                       "runs past the wsd decay start, step 80 of train.steps=100"),
    "decay_frac 0": Case(train("train.lr_schedule=wsd", "train.warmup_steps=5", "train.decay_frac=0"),
                         "train.decay_frac=0.0 must be in (0, 1)"),
    "branch with compile auto": Case(train("train.lr_schedule=wsd", "train.warmup_steps=5", "checkpoint.branches=[50]"),
                                     "checkpoint.branches needs train.compile=true or false"),
    "branch of a cosine run": Case(train("run.branch_from={tmp}/x"), "run.branch_from needs train.lr_schedule=wsd"),
    "branch steps not shorter": Case(train("train.lr_schedule=wsd", "train.warmup_steps=5", "train.compile=false",
                                           "checkpoint.branches=[100]"),
                                     "each is the train.steps of a shorter run, in [1, train.steps=100)"),
    "grad_clip negative": Case(train("train.grad_clip=-1"), "train.grad_clip=-1.0 must be >= 0"),
    "val_fraction 0": Case(train("data.val_fraction=0"), "data.val_fraction=0.0 must be in (0, 1)"),
    "norm_eps 0": Case(train("model.norm_eps=0"), "model.norm_eps=0.0 must be > 0"),
    "seq_len above model max": Case(train("train.seq_len=1024"), "exceeds model 'tiny' maximum of 256"),
    "pipeline delay 2": Case(train("engine=pipeline", "delay=2"), "supports delay 0 (1F1B) or 1 (2BW)"),
    "2BW with m < P": Case(train("engine=pipeline", "delay=1", "pipeline.stages=4", "train.micro_batches=3"),
                           "micro_batches >= pipeline.stages"),
    "more stages than layers": Case(train("engine=pipeline", "pipeline.stages=6"), "pipeline.stages=6 exceeds the 4"),
    "cut of too few blocks": Case(train("engine=pipeline", "pipeline.cut=[1,1]"), "pipeline.cut=[1, 1] holds 2 blocks"),
    "cut by name unknown": Case(train("engine=pipeline", "pipeline.cut=fast"), "pipeline.cut=fast is not allowed"),
    # -- plan --profile (issue 56): a device profile's YAML, types and ranges, one line naming the file and key
    **{f"plan --profile {why}": Case(["plan", "--profile", "{tmp}/p.yaml", "model=tiny"],
                                     f"--profile {{tmp}}/p.yaml: {said}", lambda tmp, line=line: bad_profile(tmp, line))
       for why, line, said in [
           ("malformed YAML", "matmul_flops: [", "not a readable YAML device profile"),
           ("efficiency 0", "efficiency: 0", "efficiency = 0 must be a finite number > 0 and <= 1"),
           ("efficiency -0.4", "efficiency: -0.4", "efficiency = -0.4 must be a finite number > 0 and <= 1"),
           ("matmul_flops fast", "matmul_flops: fast", "matmul_flops = 'fast' must be a finite number > 0"),
           ("overhead inf", "overhead_s: .inf", "overhead_s = inf must be a finite number >= 0"),
       ]},
    "pipedream needs delay 1": Case(train("delay_profile=pipedream", "delay=0"), "use it with delay=1"),
    "unknown engine": Case(train("engine=warp"), "engine=warp is not allowed"),
    "unknown wandb mode": Case(train("tracker.wandb.mode=sometimes"), "tracker.wandb.mode=sometimes is not allowed"),
    "unknown compile backend": Case(train("train.compile_backend=tvm"), "train.compile_backend=tvm is not allowed"),
    "config show, bad value": Case(["config", "show", "optimizer.eps=-1"], "optimizer.eps=-1.0 must be > 0"),
    "data prepare, bad value": Case(["data", "prepare", "data.val_fraction=1"], "data.val_fraction=1.0"),
    # -- keys, options and the override grammar
    "+ typo in a typed group": Case(train("+optimizer.lrr=1"), "'optimizer.lrr' (added with +); did you mean 'optimizer.lr'?"),
    "+ typo nested": Case(train("+optimizer.ef.lamm=1"), "did you mean 'optimizer.ef.lam'?"),
    "+ unknown top-level key": Case(train("+foo=1"), "unknown config key 'foo'"),
    "typo without +": Case(train("optimizer.lrr=1"), "unknown config key 'optimizer.lrr'; did you mean 'optimizer.lr'?"),
    "unknown key": Case(train("train.stepz=3"), "unknown config key 'train.stepz'; did you mean 'train.steps'?"),
    "unknown model": Case(train("model=nope"), "unknown model 'nope'"),
    "unknown optimizer": Case(train("optimizer=sgdx"), "unknown optimizer 'sgdx'"),
    "wrong type": Case(train("train.steps=many"), "'many' for 'train.steps' is not a valid int"),
    "unparsable override": Case(train("delay"), "key=value"),
    "seed list in train": Case(train("seed=0,1"), "use `asyncpipe sweep seed=0,1"),
    "seed range in train": Case(train("seed=range(0,3)"), "`asyncpipe sweep seed=range(0,3)"),
    "optimizer list in train": Case(train("optimizer=adamw,muon"), "`asyncpipe sweep optimizer=adamw,muon"),
    # -- the file system
    "run.dir is a file": Case(train("run.dir={tmp}/afile"), "run.dir {tmp}/afile is a file", afile),
    "run.dir below a file": Case(train("run.dir={tmp}/afile/run"), "run.dir {tmp}/afile/run is below {tmp}/afile", afile),
    "run.dir empty": Case(train("run.dir="), "run.dir is empty"),
    "run.dir the working directory": Case(train("run.dir=."), "run.dir=. is the working directory"),
    "run.dir above the working directory": Case(train("run.dir=.."), "run.dir=.. is above the working directory"),
    "run.dir not writable": Case(train("run.dir={ro}/asyncpipe-run"), "run.dir {ro}/asyncpipe-run: cannot write to {ro}"),
    "data root a file (prepare)": Case(["data", "prepare"], "data root {tmp}/afile is a file, not a directory; point ASYNCPIPE_DATA",
                                       afile, {"ASYNCPIPE_DATA": "{tmp}/afile"}),
    "data root a file (train)": Case(train(), "{tmp}/afile is a file", afile, {"ASYNCPIPE_DATA": "{tmp}/afile"}),
    "data root below a file (train)": Case(train(), "{tmp}/afile/data is below {tmp}/afile", afile,
                                           {"ASYNCPIPE_DATA": "{tmp}/afile/data"}),
    "data root not writable (prepare)": Case(["data", "prepare"], "{ro}/asyncpipe-data: cannot write to {ro}",
                                             env={"ASYNCPIPE_DATA": "{ro}/asyncpipe-data"}),
    "data root not writable (train)": Case(train(), "data root {ro}/asyncpipe-data: cannot write to {ro}",
                                           env={"ASYNCPIPE_DATA": "{ro}/asyncpipe-data"}),
    "report --out a file": Case(["report", "{tmp}", "--out", "{tmp}/afile"], "--out {tmp}/afile is a file", afile),
    "schedule --out a file": Case(["schedule", "--out", "{tmp}/afile"], "--out {tmp}/afile is a file", afile),
    "schedule --out below a file": Case(["schedule", "--out", "{tmp}/afile/s"], "is below {tmp}/afile", afile),
    "bench --out a directory": Case(["bench", "simulator", "--out", "{tmp}"], "--out {tmp} is a directory"),
    "bench pipeline --out below a file": Case(["bench", "pipeline", "--out", "{tmp}/afile/r.json"],
                                              "the directory of --out {tmp}/afile is a file", afile),
    "sweep --out a file": Case(["sweep", "seed=0,1", "--out", "{tmp}/afile"], "--out {tmp}/afile is a file", afile),
    "corrupt summary on resume": Case(train("resume=true"), "{tmp}/run/summary.json is not a readable run summary",
                                      corrupt_run),
    "summary not an object on resume": Case(train("resume=true"), "{tmp}/run/summary.json is not a readable",
                                            lambda tmp: corrupt_run(tmp, "[1, 2]\n")),
    "corrupt summary on sweep re-run": Case(["sweep", "seed=0,1", "--name", "sw", "--out", "{tmp}/sweeps"],
                                            "{tmp}/sweeps/sw/seed=0/summary.json is not a readable", corrupt_sweep_run),
    # -- command options
    "bench --rounds 0": Case(["bench", "simulator", "--rounds", "0"], "--rounds 0 must be >= 1"),
    "bench --rounds -2": Case(["bench", "simulator", "--rounds", "-2"], "--rounds -2 must be >= 1"),
    "bench pipeline --rounds 0": Case(["bench", "pipeline", "--rounds", "0"], "--rounds 0 must be >= 1"),
    "bench pipeline --steps 2": Case(["bench", "pipeline", "--steps", "2"], "--steps 2 leaves no timed step"),
    "schedule --forward -1": Case([*SCHED, "--forward", "-1"], "--forward -1 must be a finite time > 0"),
    "schedule --backward 0": Case([*SCHED, "--backward", "0"], "--backward 0 must be a finite time > 0"),
    "schedule --forward inf": Case([*SCHED, "--forward", "inf"], "--forward inf must be a finite time > 0"),
    "schedule --step -1": Case([*SCHED, "--step", "-1"], "--step -1 must be a finite time >= 0"),
    "schedule --stages 0": Case([*SCHED, "--stages", "0"], "--stages 0 must be >= 1"),
    "schedule --batches 0": Case([*SCHED, "--batches", "0", "--schedule", "zb-h1"], "--batches 0 must be >= 1"),
    "schedule too big": Case([*SCHED, "--stages", "64", "--micro-batches", "512"], "64x512x3 = 98304 exceeds 1024"),
    "schedule unknown": Case([*SCHED, "--schedule", "nope"], "--schedule 'nope' is unknown"),
    "schedule of a run, 1 batch": Case([*SCHED, "model=tiny", "--batches", "1"], "--batches 1: draw 2 or more"),
    "schedule of a run, too big": Case([*SCHED, "model=tiny", "--batches", "300"], "at most 1024 stages x micro-"),
    "schedule of a run and a trace": Case([*SCHED, "model=tiny", "--trace", "{tmp}"], "OVERRIDES or --trace, not both"),
    "schedule of a run, bad key": Case([*SCHED, "model=tiny", "pipeline.stagez=2"], "pipeline.stagez"),
    "schedule paci with m < P": Case([*SCHED, "--schedule", "paci", "--stages", "4", "--micro-batches", "2"],
                                     "--schedule paci needs --micro-batches >= --stages, got 2 < 4"),
    # -- a module named by import path that goes wrong when imported (issue 56; tests/user_lab)
    "schedule module raising": Case(train("pipeline.schedule=user_lab.raises_at_import"),
                                    "pipeline.schedule=user_lab.raises_at_import: importing user_lab.raises_at_import "
                                    "failed (RuntimeError: the lab's cluster is not reachable)"),
    "optimizer module raising": Case(train("optimizer._target_=user_lab.raises_at_import"),
                                     "importing user_lab.raises_at_import failed (RuntimeError"),
    "schedule under a built-in's name": Case(train("pipeline.schedule=user_lab.declares_paci"),
                                             "schedule 'paci' is already declared by asyncpipe.schedules.paci; "
                                             "user_lab.declares_paci must declare its schedule under another name"),
    "optimizer under a built-in's name": Case(train("optimizer._target_=user_lab.declares_adamw"),
                                              "optimizer 'adamw' is already declared by asyncpipe.optimizers.adamw"),
    "report without a source": Case(["report"], "give a sweep directory"),
    "report --wandb without --group": Case(["report", "--wandb", "me/proj"], "--wandb needs --group"),
    "report on a dir without runs": Case(["report", "{tmp}"], "no runs found"),
    "sweep file with a swept variant": Case(["sweep", "--file", "{tmp}/bad.yaml", "--out", "{tmp}/sweeps"], "is a sweep",
                                            bad_sweep_file),
    "sweep status without a dir": Case(["sweep", "status"], "Missing argument 'sweep_dir'"),
    # -- click usage errors: one line too, no boxed panel
    "unknown command": Case(["trian"], "No such command 'trian'"),
    "data glob matching nothing (prepare)": Case(["data", "prepare", "data=files", "data.paths=[{tmp}/none/*.jsonl]"],
                                                 "data.paths: {tmp}/none/*.jsonl matches no file"),
    "data glob matching nothing (train)": Case(train("data=files", "data.paths=[{tmp}/none/*.txt]", "optimizer.lr=0.005"),
                                               "data.paths: {tmp}/none/*.txt matches no file"),
    "tokenizer file missing": Case(["data", "prepare", "tokenizer=hf", "tokenizer.path={tmp}/none.json"],
                                   "tokenizer.path {tmp}/none.json is not a file"),
    "tokenizer file not a tokenizer": Case(["data", "prepare", "tokenizer=hf", "tokenizer.path={tmp}/afile"],
                                           "tokenizer.path {tmp}/afile is not a Hugging Face tokenizer.json", afile),
    "tokenizer=ids on text": Case(["data", "prepare", "tokenizer=ids", "tokenizer.vocab_size=100"],
                                  "tokenizer=ids declares token ids prepared elsewhere: data=tokens only"),
    "unknown subcommand": Case(["data", "prepar"], "No such command 'prepar'"),
    "unknown flag": Case(["train", "--nope"], "No such option: --nope"),
    "unknown report flag": Case(["report", "--nope"], "No such option: --nope"),
    "flag with a bad number": Case(["schedule", "--stages", "abc"], "Invalid value for '--stages'"),
    # -- a --bench file's numbers (issue 56): one line naming the file and key, before any report file is written
    **{f"report --bench {why}": Case(["report", "{tmp}", "--bench", "{tmp}/b.json", "--out", "{tmp}/o"],
                                     f"--bench {{tmp}}/b.json: {said}",
                                     lambda tmp, body=body: (tmp / "b.json").write_text(
                                         '{"stages": %s, "micro_batches": 4, "variants": {"1f1b": {"ratio_to_1f1b": '
                                         '1.0, "seconds_by_op_per_stage": [{"ForwardPass": %s}]}, "2bw": %s}}' % body))
       for why, body, said in [
           ("ratio 'fast'", ("2", "0.5", '{"ratio_to_1f1b": "fast"}'),
            "variants.2bw.ratio_to_1f1b = 'fast' is not a finite positive number"),
           ("ratio 0", ("2", "0.5", '{"ratio_to_1f1b": 0}'), "variants.2bw.ratio_to_1f1b = 0 is not a finite positive"),
           ("ratio -1", ("2", "0.5", '{"ratio_to_1f1b": -1}'), "variants.2bw.ratio_to_1f1b = -1 is not a finite"),
           ("ratio true", ("2", "0.5", '{"ratio_to_1f1b": true}'), "variants.2bw.ratio_to_1f1b = True is not"),
           ("round NaN", ("2", "0.5", '{"ratio_to_1f1b": 1.2, "ratio_to_1f1b_per_round": [1.2, NaN]}'),
            "variants.2bw.ratio_to_1f1b_per_round[1] = nan is not a finite positive number"),
           ("rounds not a list", ("2", "0.5", '{"ratio_to_1f1b": 1.2, "tokens_per_s_per_round": 3}'),
            "variants.2bw.tokens_per_s_per_round = 3 is not a list"),
           ("step time 0", ("2", "0.5", '{"ratio_to_1f1b": 1.2, "step_time_s": 0}'),
            "variants.2bw.step_time_s = 0 is not a finite positive number"),
           ("forward time -1", ("2", "-1", '{"ratio_to_1f1b": 1.2}'),
            "variants.1f1b.seconds_by_op_per_stage[0].ForwardPass = -1 is not a finite positive time"),
           ("stages 0", ("0", "0.5", '{"ratio_to_1f1b": 1.2}'), "stages = 0 is not a whole number >= 1"),
       ]},  # fmt: skip
    # -- bench pipeline's numeric flags (issue 56): type and range, one line before torch is imported
    "bench pipeline --warmup-steps -1": Case(["bench", "pipeline", "--warmup-steps", "-1"],
                                             "--warmup-steps -1 must be >= 1"),
    "bench pipeline --warmup-steps 0": Case(["bench", "pipeline", "--warmup-steps", "0"], "--warmup-steps 0 must be >= 1"),
    "bench pipeline --steps -5": Case(["bench", "pipeline", "--steps", "-5"], "--steps -5 leaves no timed step"),
    "bench pipeline --rounds -1": Case(["bench", "pipeline", "--rounds", "-1"], "--rounds -1 must be >= 1"),
    "bench pipeline --rounds abc": Case(["bench", "pipeline", "--rounds", "abc"], "Invalid value for '--rounds'"),
    "bench pipeline --warmup-steps 1.5": Case(["bench", "pipeline", "--warmup-steps", "1.5"],
                                              "Invalid value for '--warmup-steps'"),
    "bench pipeline --compile fast": Case(["bench", "pipeline", "--compile", "fast"],
                                          "--compile fast: give eager, compiled or both"),
}


def _tree(*roots: Path) -> dict[str, tuple]:
    """Every path under the roots with its kind, size and modification time."""
    out = {}
    for root in roots:
        for dirpath, dirs, files in os.walk(root):
            for name in dirs + files:
                p = Path(dirpath) / name
                st = p.lstat()
                out[str(p)] = (p.is_dir(), st.st_size, st.st_mtime_ns)
    return out


@pytest.fixture(scope="module")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One prepared hamlet/byte data root, so config cases get past data preparation checks."""
    from asyncpipe.config import compose
    from asyncpipe.data import prepare

    root = tmp_path_factory.mktemp("table_data")
    os.environ["ASYNCPIPE_DATA"], old = str(root), os.environ.get("ASYNCPIPE_DATA")
    try:
        cfg = compose([])
        prepare(cfg.data, cfg.tokenizer)
    finally:
        if old is None:
            del os.environ["ASYNCPIPE_DATA"]
        else:
            os.environ["ASYNCPIPE_DATA"] = old
    return root


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input(name: str, tmp_path: Path, data_root: Path, monkeypatch: pytest.MonkeyPatch,
                   capsys: pytest.CaptureFixture) -> None:  # fmt: skip
    case = CASES[name]
    uses_ro = any("{ro}" in s for s in [*case.argv, case.needle, *case.env.values()])
    if uses_ro and (not os.path.isdir(READ_ONLY) or os.access(READ_ONLY, os.W_OK)):
        pytest.skip(f"needs a directory nobody may write to ({READ_ONLY})")
    fill = lambda s: s.replace("{tmp}", str(tmp_path)).replace("{ro}", READ_ONLY)  # noqa: E731
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)  # default run dirs (runs/...) would land here
    monkeypatch.setenv("ASYNCPIPE_DATA", str(data_root))
    for key, value in case.env.items():
        monkeypatch.setenv(key, fill(value))
    if case.setup:
        case.setup(tmp_path)
    before = _tree(tmp_path, data_root)
    capsys.readouterr()

    with pytest.raises(SystemExit) as exit_:
        main([fill(a) for a in case.argv])

    err = capsys.readouterr().err
    assert exit_.value.code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert fill(case.needle) in lines[0]
    assert _tree(tmp_path, data_root) == before, "a refused command wrote files"


def test_slurm_launcher_without_sbatch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture) -> None:  # fmt: skip
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no sbatch anywhere on PATH
    with pytest.raises(SystemExit) as exit_:
        main(["sweep", "optimizer=adamw,muon", "launcher=slurm", "--out", str(tmp_path / "sweeps")])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1 and "sbatch" in err[0]
    assert not (tmp_path / "sweeps").exists()
