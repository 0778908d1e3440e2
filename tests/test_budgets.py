"""Budgets from one run (issue 37): a wsd run checkpoints at the decay starts of shorter runs
(`checkpoint.branches`), and each shorter run is a cooldown branch from there (`run.branch_from`) that equals,
bit for bit, the same run trained alone from step 0 with the same seed."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncpipe.errors import UserError

TINY = ["model=tiny", "data=hamlet", "device=cpu", "precision=fp32", "train.compile=false", "train.seq_len=16",
        "train.micro_batch_size=2", "train.micro_batches=2", "train.eval_every=3", "train.eval_batches=2",
        "train.lr_schedule=wsd", "train.warmup_steps=2", "train.decay_frac=0.25", "tracker.wandb.mode=disabled",
        "optimizer=adamw", "optimizer.lr=0.01", "delay=1", "seed=3"]  # fmt: skip
VARYING = ("step_time", "tokens_per_s", "wall_time", "compile_step")  # clock readings, not results


def _run(run_dir: Path, *extra: str) -> tuple[dict, dict]:
    """`asyncpipe train` in this process (config.yaml, metrics, summary written); returns (summary, final state)."""
    from asyncpipe.config import compose
    from asyncpipe.run import run_training
    from asyncpipe.trainer import Trainer

    cfg = compose([*TINY, f"run.dir={run_dir}", *extra])
    states: list[dict] = []
    real = Trainer.run

    def keep_state(self: Trainer, *args: Any, **kwargs: Any) -> dict:
        out = real(self, *args, **kwargs)
        states.append(self.engine.state_dict())
        return out

    Trainer.run = keep_state  # type: ignore[method-assign]
    try:
        summary = run_training(cfg, log=lambda _: None)
    finally:
        Trainer.run = real  # type: ignore[method-assign]
    return summary, states[0]


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def _metrics(run_dir: Path) -> list[dict]:
    from asyncpipe.track import RunDir

    return [{k: v for k, v in r.items() if k not in VARYING} for r in RunDir(run_dir).read_metrics()]


@pytest.fixture(scope="module")
def family(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("budgets")
    out = {}
    out["alone6"] = (root / "alone6", *_run(root / "alone6", "train.steps=6"))
    out["alone8"] = (root / "alone8", *_run(root / "alone8", "train.steps=8"))
    out["trunk"] = (root / "trunk", *_run(root / "trunk", "train.steps=8", "checkpoint.branches=[6]"))
    out["branch6"] = (root / "branch6", *_run(root / "branch6", "train.steps=6", f"run.branch_from={root / 'trunk'}"))
    return out


def test_a_branch_equals_its_standalone_run_bit_for_bit(family: dict) -> None:
    """6 steps, decay_frac 0.25: decay starts at step 6 - 2 = 4; the 8-step run's stable phase holds steps 2..5,
    so its checkpoint after step 4 is the 6-step run's state there. The branch trains steps 5-6 from it."""
    alone, (branch_dir, branch, branch_state) = family["alone6"], family["branch6"]
    assert branch["branch_of"] == str(family["trunk"][0]) and branch["branch_step"] == 4
    assert _equal(branch_state, alone[2])  # weights, optimizer moments, delayed weights, step, RNG
    assert branch["final_val_loss"] == alone[1]["final_val_loss"]
    assert _metrics(branch_dir) == _metrics(alone[0])  # the parent's steps 0-4, then its own 5-6: every loss equal
    assert [r["step"] for r in _metrics(branch_dir) if "train_loss" in r] == [1, 2, 3, 4, 5, 6]
    assert branch["tokens"] == alone[1]["tokens"] and branch["epochs"] == alone[1]["epochs"] > 0


def test_the_trunk_is_its_own_standalone_run_and_keeps_the_branch_checkpoint(family: dict) -> None:
    trunk_dir, trunk, trunk_state = family["trunk"]
    assert _equal(trunk_state, family["alone8"][2]) and trunk["final_val_loss"] == family["alone8"][1]["final_val_loss"]
    kept = sorted(p.name for p in (trunk_dir / "checkpoints").iterdir())
    assert kept == ["step_00000004"]  # checkpoint.keep=2 prunes others; a branch point never
    lrs = [r["lr"] for r in _metrics(trunk_dir) if "lr" in r]
    assert lrs[:4] == [0.005, 0.01, 0.01, 0.01]  # warm-up 2, then the peak: shared by both lengths


def test_a_branch_from_another_run_or_before_its_parent_is_refused(family: dict, tmp_path: Path) -> None:
    trunk_dir = family["trunk"][0]
    with pytest.raises(UserError, match=r"ran other settings \(optimizer.lr: 0.01 -> 0.02\)"):
        _run(tmp_path / "b1", "train.steps=6", "optimizer.lr=0.02", f"run.branch_from={trunk_dir}")
    with pytest.raises(UserError, match="no complete checkpoint at or before step 3"):
        _run(tmp_path / "b2", "train.steps=4", f"run.branch_from={family['alone8'][0]}")
    with pytest.raises(UserError, match="is not a run dir"):
        _run(tmp_path / "b3", "train.steps=6", f"run.branch_from={tmp_path / 'nothing'}")


def test_a_branch_is_exact_or_refused_inside_its_parents_own_decay(family: dict, tmp_path: Path) -> None:
    """A 6-step parent decays from step 4. An 8-step run (decay from 6) may branch only from a checkpoint at step 4
    or before: the parent's step-5 checkpoint is decayed, so with only that one the branch is refused (nothing
    written); with one at step 3 the branch is its 8-step run trained alone, bit for bit."""
    decayed, early = tmp_path / "decayed", tmp_path / "early"
    _run(decayed, "train.steps=6", "checkpoint.every=5")
    assert sorted(p.name for p in (decayed / "checkpoints").iterdir()) == ["step_00000005"]
    with pytest.raises(UserError, match=r"no complete checkpoint at or before step 4 \(the parent's decay start"):
        _run(tmp_path / "inexact", "train.steps=8", f"run.branch_from={decayed}")
    assert not (tmp_path / "inexact").exists()
    _run(early, "train.steps=6", "checkpoint.every=3")
    summary, state = _run(tmp_path / "exact", "train.steps=8", f"run.branch_from={early}")
    assert (summary["branch_of"], summary["branch_step"]) == (str(early), 3)
    assert _equal(state, family["alone8"][2]) and summary["final_val_loss"] == family["alone8"][1]["final_val_loss"]


# -- the sweep grammar: `budgets:` ---------------------------------------------------------------------------
FAMILY = """\
name: ladder
grid:
  seed: [0]
variants:
  sync: [delay=0]
  1-step: [delay=1]
budgets: [1, 1.5, 2]
overrides: [{overrides}]
"""
SWEEP_TINY = [o for o in TINY if not o.startswith(("delay=", "seed="))] + ["train.steps=4", "launcher.parallel=1"]


def _family_file(tmp_path: Path, budgets: str = "[1, 1.5, 2]", extra: tuple[str, ...] = ()) -> Path:
    path = tmp_path / "ladder.yaml"
    path.write_text(FAMILY.replace("[1, 1.5, 2]", budgets).format(overrides=", ".join([*SWEEP_TINY, *extra])))
    return path


def test_budgets_expand_to_one_run_and_its_branches_per_variant(tmp_path: Path) -> None:
    from asyncpipe.sweep import plan_sweep
    from asyncpipe.sweep.expand import run_overrides

    plan = plan_sweep(file=_family_file(tmp_path))
    names = [r.name for r in plan.runs]
    assert names == ["seed=0,variant=sync,budget=2", "seed=0,variant=sync,budget=1", "seed=0,variant=sync,budget=1.5",
                     "seed=0,variant=1-step,budget=2", "seed=0,variant=1-step,budget=1",
                     "seed=0,variant=1-step,budget=1.5"]  # fmt: skip
    trunk, one, mid = plan.runs[3:]
    assert trunk.parent is None and trunk.branches == (4, 6) and one.parent == mid.parent == trunk.name
    assert "train.steps=8" in trunk.overrides and "run.variant='1-step(x2)'" in trunk.overrides
    assert "train.steps=4" in one.overrides and "run.variant='1-step'" in one.overrides  # 1x keeps the name
    assert "run.variant='1-step(x1.5)'" in mid.overrides
    branch = run_overrides(plan, mid, tmp_path / "ladder" / mid.name, resume=False)
    assert f"run.branch_from='{tmp_path / 'ladder' / trunk.name}'" in branch
    assert "checkpoint.branches=[4,6]" in run_overrides(plan, trunk, tmp_path / "ladder" / trunk.name, resume=False)


def test_a_variant_may_set_its_own_budgets_or_none(tmp_path: Path) -> None:
    """v5 part 2's shape: sync at 1x only (`budgets: []`), 1-step at the file's budgets, 1-step+EF at its own."""
    from asyncpipe.sweep import plan_sweep

    path = _family_file(tmp_path)
    path.write_text(path.read_text().replace("  sync: [delay=0]\n", "  sync: {overrides: [delay=0], budgets: []}\n")
                    .replace("  1-step: [delay=1]\n", "  1-step: [delay=1]\n  1-step+EF: {overrides: [delay=1, "
                             "optimizer.ef.enabled=true], budgets: [1, 2]}\n"))  # fmt: skip
    plan = plan_sweep(file=path)
    assert [(r.name, r.parent) for r in plan.runs] == [
        ("seed=0,variant=sync", None),
        ("seed=0,variant=1-step,budget=2", None), ("seed=0,variant=1-step,budget=1", "seed=0,variant=1-step,budget=2"),
        ("seed=0,variant=1-step,budget=1.5", "seed=0,variant=1-step,budget=2"),
        ("seed=0,variant=1-step+EF,budget=2", None),
        ("seed=0,variant=1-step+EF,budget=1", "seed=0,variant=1-step+EF,budget=2")]  # fmt: skip
    assert "run.variant='sync'" in plan.runs[0].overrides and plan.runs[0].budget is None
    path.write_text(path.read_text().replace("budgets: [1, 2]}", "budgets: [1, 2], seeds: [1]}"))
    with pytest.raises(UserError, match="variant 1-step\\+EF: unknown key\\(s\\) seeds; allowed: overrides, budgets"):
        plan_sweep(file=path)


def test_the_cost_of_six_rungs_from_one_run(tmp_path: Path) -> None:
    """1x..2.5x of 1100 steps, decay_frac 0.2: the 2.5x run (2750 steps) plus the five shorter decays
    (220 + 275 + 330 + 385 + 440 = 1650 steps) = 4400 steps = 4.00 run-equivalents, 1.60x the longest rung alone;
    separate runs: 1 + 1.25 + 1.5 + 1.75 + 2 + 2.5 = 10 run-equivalents, 4x."""
    from asyncpipe.sweep import plan_sweep
    from asyncpipe.sweep.budgets import family_costs, render_costs
    from asyncpipe.sweep.runner import compose_runs

    path = _family_file(tmp_path, "[1, 1.25, 1.5, 1.75, 2, 2.5]", ("train.steps=1100", "train.warmup_steps=110",
                                                                   "train.decay_frac=0.2"))  # fmt: skip
    plan = plan_sweep(file=path)
    cfgs, _ = compose_runs(plan, tmp_path / "ladder")
    costs = family_costs(plan, cfgs)
    assert len(costs) == 2 and costs[0].trained == [1100 - 880, 1375 - 1100, 1650 - 1320, 1925 - 1540, 2200 - 1760, 2750]
    assert (costs[0].branched, costs[0].separate, costs[0].longest) == (4.0, 10.0, 2.5)
    assert render_costs(costs) == (
        "budgets 1, 1.25, 1.5, 1.75, 2, 2.5 (1x = 1100 steps), 2 families: each 4.00 run-equivalents as one run and "
        "its cooldown branches, 10.00 as separate runs (1.60x its longest rung alone, against 4.00x)")


@pytest.mark.parametrize("budgets, extra, needle", [
    ("[1, 1.3]", (), "1.3 x train.steps=4 = 5.2 is not a whole number of steps"),
    ("[1, 1]", (), "repeats a budget"),
    ("[1, -2]", (), "must be positive numbers"),
    ("[1, 2]", ("launcher=slurm",), "launcher=slurm does not yet"),
    ("[1, 2]", ("train.lr_schedule=cosine",), "checkpoint.branches needs train.lr_schedule=wsd"),
])  # fmt: skip
def test_bad_budgets_are_one_line(tmp_path: Path, budgets: str, extra: tuple, needle: str) -> None:
    from asyncpipe.sweep import dry_run_sweep

    with pytest.raises(UserError) as err:
        dry_run_sweep(file=_family_file(tmp_path, budgets, extra), out=tmp_path / "out")
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_a_budget_sweep_runs_branches_after_their_parent_and_extends(tmp_path: Path) -> None:
    """The real `asyncpipe train` per run: the 2x rung first, then its branches; status and summaries name the
    parent and branch step; a re-run skips them; a new rung (1.25x) branches from the same parent's kept
    checkpoint; a branch equals its rung trained alone."""
    from asyncpipe.sweep import run_sweep, sweep_status
    from asyncpipe.sweep.display import SweepDisplay
    from asyncpipe.track import read_summary
    from helpers import asyncpipe

    quiet = SweepDisplay("t", stream=io.StringIO(), live=False)
    path = _family_file(tmp_path, extra=("launcher.parallel=2",))
    path.write_text(path.read_text().replace("  1-step: [delay=1]\n", ""))
    result = run_sweep(file=path, out=tmp_path / "out", display=quiet)
    assert [s.state for s in result.states] == ["completed"] * 3
    sweep = tmp_path / "out" / "ladder"
    trunk = "seed=0,variant=sync,budget=2"
    one = read_summary(sweep / "seed=0,variant=sync,budget=1")
    assert (one["branch_of"], one["branch_step"], one["steps"]) == (str(sweep / trunk), 3, 4)
    assert read_summary(sweep / "seed=0,variant=sync,budget=1.5")["branch_step"] == 4
    assert sorted(p.name for p in (sweep / trunk / "checkpoints").iterdir()) == ["step_00000003", "step_00000004"]
    table = io.StringIO()
    sweep_status(sweep, table)
    assert f"{trunk} @ 4" in table.getvalue().replace("\n", "")
    from asyncpipe.report import build_report

    report = build_report(sweep, out_dir=tmp_path / "report")
    assert list(dict.fromkeys(report.runs["variant"])) == ["sync", "sync(x1.5)", "sync(x2)"]
    runs_md = (tmp_path / "report" / "report.md").read_text().split("## Runs")[1]
    assert "branch of" in runs_md and runs_md.count(trunk) == 3  # its own row, and the parent of two branches
    manifest = json.loads((sweep / "sweep.json").read_text())
    assert "each 2.75 run-equivalents" in manifest["budget_cost"]  # 8 steps + decays of 1 (4 steps) and 2 (6 steps)
    assert "(1.38x its longest rung alone, against 2.25x)" in manifest["budget_cost"]

    path.write_text(path.read_text().replace("[1, 1.5, 2]", "[1, 1.25, 1.5, 2]"))
    again = run_sweep(file=path, out=tmp_path / "out", display=quiet)
    assert [s.note for s in again.states if s.name != "seed=0,variant=sync,budget=1.25"] == ["already completed"] * 3
    added = read_summary(sweep / "seed=0,variant=sync,budget=1.25")  # 5 steps, decay at 4: the kept step-4 checkpoint
    assert (added["status"], added["branch_step"]) == ("completed", 4)

    alone = tmp_path / "alone"
    proc = asyncpipe("train", *SWEEP_TINY, "delay=0", "seed=0", "train.steps=6", f"run.dir={alone}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert read_summary(alone)["final_val_loss"] == read_summary(sweep / "seed=0,variant=sync,budget=1.5")["final_val_loss"]


def test_a_sweep_trains_a_trunk_again_when_its_branch_checkpoints_are_gone(tmp_path: Path, capsys) -> None:
    """Advice that works: a finished 2x trunk whose checkpoints were deleted, and a new 1.5x rung. The sweep retires
    the trunk (kept in .retired/) and trains it again before the rung, instead of failing the rung with advice
    (`--retry-failed`, `checkpoint.branches=[...]`) that would fail the same way."""
    from asyncpipe.sweep import run_sweep
    from asyncpipe.sweep.display import SweepDisplay
    from asyncpipe.track import read_summary

    quiet = SweepDisplay("t", stream=io.StringIO(), live=False)
    path = _family_file(tmp_path, budgets="[1, 2]")
    path.write_text(path.read_text().replace("  1-step: [delay=1]\n", ""))
    assert [s.state for s in run_sweep(file=path, out=tmp_path / "out", display=quiet).states] == ["completed"] * 2
    sweep, trunk = tmp_path / "out" / "ladder", "seed=0,variant=sync,budget=2"
    first = read_summary(sweep / trunk)
    shutil.rmtree(sweep / trunk / "checkpoints")
    path.write_text(path.read_text().replace("[1, 2]", "[1, 1.5, 2]"))
    capsys.readouterr()
    again = run_sweep(file=path, out=tmp_path / "out", display=quiet)
    assert {s.name: s.state for s in again.states}["seed=0,variant=sync,budget=1.5"] == "completed"
    assert f"{trunk}: completed, but its checkpoint at step 4" in capsys.readouterr().out
    assert read_summary(sweep / trunk)["final_val_loss"] == first["final_val_loss"]  # the same run, trained again
    assert [p.name.split(".")[0] for p in (sweep / ".retired").iterdir()] == [trunk]
    assert read_summary(sweep / "seed=0,variant=sync,budget=1.5")["branch_step"] == 4


# -- enough data: data=mix, epochs in every summary, the report's warning ------------------------------------
STUDY_TOKENS_2_5X = 2750 * 8 * 4 * 128  # the study regime's 2.5x rung: 1100 x 2.5 steps of 8 x 4 x 128 tokens


def test_the_mix_holds_the_study_regimes_longest_rung_within_one_epoch() -> None:
    """data=mix (Shakespeare's plays + the KJV's chapters + torch's docstrings, byte tokens): its train split is
    larger than the 11.26M tokens of the 2.5x rung, so no study run repeats data; the parts keep their own
    document units and nothing overlaps between train and val."""
    from asyncpipe.config import compose
    from asyncpipe.data import ensure_prepared, load_manifest

    cfg = compose(["model=tiny", "data=mix", "tokenizer=byte"])
    manifest = load_manifest(ensure_prepared(cfg.data, cfg.tokenizer))
    assert manifest["tokens"]["train"] > STUDY_TOKENS_2_5X == 11_264_000
    assert STUDY_TOKENS_2_5X / manifest["tokens"]["train"] < 0.9 and manifest["tokens"]["val"] > 1_000_000
    parts = {s["name"].split("/", 1)[0] for s in manifest["sources"]}
    assert parts == {"shakespeare", "kjv", "torchdoc"}


@pytest.mark.parametrize("sources, needle", [
    ("[hamlet]", "data=mix needs data.sources: distinct parts among shakespeare, kjv, torchdoc"),
    ("[kjv,kjv]", "data=mix needs data.sources: distinct parts"),
    ("[]", "data=mix needs data.sources"),
])  # fmt: skip
def test_a_bad_mix_is_one_line(sources: str, needle: str, tmp_path: Path) -> None:
    from asyncpipe.data.corpora import load_corpus

    with pytest.raises(UserError) as err:
        load_corpus("mix", [s for s in sources.strip("[]").split(",") if s], tmp_path)
    assert needle in str(err.value)


def test_every_summary_counts_epochs_and_the_report_warns_of_repeated_data(family: dict, tmp_path: Path) -> None:
    """The 8-step runs train 8 x 2 x 2 x 16 = 512 tokens; epochs = 512 / Hamlet's train split. A record claiming
    1.4 epochs makes the report warn; one under 1 does not."""

    from asyncpipe.config import compose
    from asyncpipe.data import dataset_dir, load_manifest
    from asyncpipe.report import build_report
    from asyncpipe.track import RunDir

    cfg = compose(TINY)
    train = load_manifest(dataset_dir(cfg.data, cfg.tokenizer))["tokens"]["train"]
    assert family["alone8"][1]["epochs"] == 8 * 2 * 2 * 16 / train
    root = tmp_path / "sweeps" / "s"
    root.mkdir(parents=True)
    for name in ("alone6", "alone8"):
        shutil.copytree(family[name][0], root / name, ignore=shutil.ignore_patterns("checkpoints", ".*lock"))
    assert not [w for w in build_report(root).warnings if "repeated data" in w]
    summary = RunDir(root / "alone8").read_summary()
    RunDir(root / "alone8").write_summary({**summary, "epochs": 1.4})
    report = build_report(root, out_dir=tmp_path / "report")
    warned = [w for w in report.warnings if "repeated data" in w]
    assert "| 1.40 " in (tmp_path / "report" / "report.md").read_text()  # the runs table shows each run's epochs
    assert warned == ["1 run(s) repeated data: up to 1.40 epochs of their train split (alone8); compare them with "
                      "care, or train on a larger corpus (data=mix)"]


def test_the_performance_doc_states_the_committed_sweeps_cost() -> None:
    """docs/performance.md's step figures are what `asyncpipe sweep --dry-run` computes for sweeps/budgets_cost.yaml."""
    from asyncpipe.sweep import plan_sweep
    from asyncpipe.sweep.budgets import family_costs
    from asyncpipe.sweep.runner import compose_runs

    repo = Path(__file__).resolve().parents[1]
    plan = plan_sweep(file=repo / "sweeps" / "budgets_cost.yaml")
    cfgs, _ = compose_runs(plan, repo / "runs" / "unused")
    (cost,) = family_costs(plan, cfgs)
    doc = (repo / "docs" / "performance.md").read_text()
    assert (f"{cost.branched:.2f} run-equivalents\n({cost.branched / cost.longest:.2f}x the longest rung alone) "
            f"against {cost.separate:.2f} for six separate runs ({cost.separate / cost.longest:.2f}x)") in doc
    assert "sweeps/budgets_cost.yaml --out runs/budgets            # 42.7 s" in doc and "# 34.8 s" in doc
    assert "# 457.8 s" in doc and "# 294.8 s" in doc and "417.2 s against 270.8 s, 1.54x" in doc
    assert "cost 1.23x the longest rung alone at 40 steps" in doc and "1.55x at the study batch" in doc
    assert [round(a / b, 2) for a, b in ((42.7, 34.8), (457.8, 294.8), (417.2, 270.8))] == [1.23, 1.55, 1.54]
    assert 34.2 + 37.7 + 44.7 + 17.9 + 223.7 + 59.0 == pytest.approx(417.2)  # the six summaries' wall_time


@pytest.mark.parametrize("name, extra, lrs", [
    ("lr_adamw", ["optimizer=adamw", "optimizer.lr=0.004,0.008,0.016"], [0.004, 0.008, 0.016]),
    ("lr_muon", ["optimizer=muon", "optimizer.lr=0.01,0.02,0.04"], [0.01, 0.02, 0.04]),
])  # fmt: skip
def test_the_study5_part1_sweep_composes_as_its_comment_says(name: str, extra: list, lrs: list) -> None:
    """sweeps/study5_lr.yaml (issue 42, part 1): 3 lrs x seeds 0-2 x sync / 1-step, wsd on data=mix, every run
    valid; the two commands of its comment."""
    from asyncpipe.sweep import plan_sweep
    from asyncpipe.sweep.runner import compose_runs

    repo = Path(__file__).resolve().parents[1]
    plan = plan_sweep(extra, file=repo / "sweeps" / "study5_lr.yaml", name=name)
    cfgs, _ = compose_runs(plan, repo / "runs" / "unused")
    assert len(cfgs) == 18
    assert sorted({c.optimizer.lr for c in cfgs.values()}) == lrs and {c.seed for c in cfgs.values()} == {0, 1, 2}
    assert {(c.run.variant, c.delay, c.train.lr_schedule) for c in cfgs.values()} == {("sync", 0, "wsd"),
                                                                                       ("1-step", 1, "wsd")}
    assert {(c.data.name, c.train.steps, c.train.warmup_steps) for c in cfgs.values()} == {("mix", 1100, 110)}
