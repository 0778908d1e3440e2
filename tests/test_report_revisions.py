"""Method revisions: every optimizer and compensation method declares the revision of its rule, a run records it,
and a report never pools or names runs of different revisions as one (older records get theirs from their commit,
asyncpipe.report.revisions)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from asyncpipe import registry
from asyncpipe.config import compose
from asyncpipe.report import build_report, revisions
from asyncpipe.report.target import tokens_table
from asyncpipe.schedules import revisions as run_revisions
from asyncpipe.schedules import schedules
from asyncpipe.track import RunDir

REPO = Path(__file__).resolve().parents[1]
DELAY = {"sync": 0, "1-step": 1, "1-step+stage_lr": 1}


def test_each_rules_declared_revision_is_the_last_in_the_history_table():
    for spec in registry.optimizers():
        assert spec.revision == revisions.current("optimizer", spec.name), spec.name
    for spec in registry.methods():
        assert spec.revision == revisions.current("compensation", spec.name), spec.name
    for spec in schedules():
        assert spec.revision == revisions.current("schedule", spec.name), spec.name
    assert registry.method_spec("stage_lr").revision == 2 and registry.method_spec("ef").revision == 1
    for (kind, name), history in revisions.HISTORY.items():
        assert [r.number for r in history] == list(range(1, len(history) + 1)), name


def test_a_run_records_the_revisions_of_the_rules_it_runs():
    cfg = compose(["model=tiny", "delay=1", "delay_profile=pipedream", "pipeline.stages=4", "compensation=stage_lr"])
    assert run_revisions(cfg) == {"optimizer": {"name": "adamw", "revision": 1},
                                       "compensation": {"name": "stage_lr", "revision": 2},
                                       "schedule": {"name": "pipedream", "revision": 1}}  # fmt: skip
    paci = compose(["model=tiny", "delay=1", "pipeline.schedule=paci", "pipeline.clip=stage", "train.micro_batches=2"])
    assert run_revisions(paci)["schedule"] == {"name": "paci", "revision": 2}  # in place since r2
    ef = compose(["model=tiny", "delay=1", "optimizer=muon_ef"])
    assert run_revisions(ef)["compensation"] == {"name": "ef", "revision": 1}  # EF is the method `ef`


def write(root: Path, variant: str, seed: int, loss: float, prov: dict | None) -> None:
    cfg = {"model": {"name": "tiny"}, "data": {"name": "hamlet"}, "seed": seed, "delay": DELAY[variant],
           "engine": "simulate", "delay_profile": "uniform", "train": {"steps": 10},
           "optimizer": {"name": "adamw", "lr": 1e-3, "ef": {"enabled": False, "lam": 1.0}},
           "compensation": {"name": "stage_lr" if "stage_lr" in variant else "none"},
           "run": {"variant": variant}}  # fmt: skip
    run = RunDir(root / f"{variant}-s{seed}")
    run.write_config(yaml.safe_dump(cfg))
    run.append_metrics({"step": 10, "tokens": 1000, "val_loss": loss})
    run.write_summary({"status": "completed", "final_val_loss": loss, "tokens": 1000})
    if prov is not None:
        (root / f"{variant}-s{seed}" / "provenance.json").write_text(json.dumps(prov))


def test_runs_of_an_older_rule_are_named_apart_and_never_pooled(tmp_path):
    """Two sweeps both name a column `1-step+stage_lr`: the old one's runs record no revision and started before
    the rule changed (a commit git does not know), the new one's record revision 2. Merged, they form two cells,
    the old one named `1-step+stage_lr@r1`, and a warning says what r1 computed."""
    old_prov = {"started": "2026-12-01T12:10:40", "git": {"commit": "0123456789abcdef", "dirty": True}}
    new_prov = {"started": "2026-12-03T08:00:00", "revisions": {
        "optimizer": {"name": "adamw", "revision": 1}, "compensation": {"name": "stage_lr", "revision": 2}}}
    for name, prov in (("old", old_prov), ("new", new_prov)):
        root = tmp_path / name
        root.mkdir()
        (root / "sweep.json").write_text(json.dumps({"name": name, "variants": {v: [] for v in DELAY}}))
        for seed in range(2) if name == "old" else range(2, 4):
            for variant in DELAY:
                write(root, variant, seed, 3.0 + 0.1 * DELAY[variant] + 0.01 * seed, prov)
    report = build_report([tmp_path / "old", tmp_path / "new"], out_dir=tmp_path / "out", plots=False, merge=True)
    cells = report.cells.set_index("variant")
    assert cells.loc["1-step+stage_lr@r1", "n"] == 2 and cells.loc["1-step+stage_lr", "n"] == 2
    assert cells.loc["1-step", "n"] == 4  # the rule-free columns still pool
    said = next(w for w in report.warnings if w.startswith("stage_lr@r1"))
    assert "lr / (1 + k)" in said and "started 2026-12-01 12:10, before 262fe8d" in said


def test_a_record_without_a_revision_gets_it_from_its_commit():
    """v3's mitigation records ran at 5344c72 (before 262fe8d changed stage_lr), v4's part 4 at 520539e (after)."""
    if subprocess.run(["git", "-C", str(REPO), "cat-file", "-e", "5344c723f18f8185645c81b86cf9617eedf42348"],
                      capture_output=True).returncode != 0:  # fmt: skip
        pytest.skip("not a git checkout holding the study's commits")
    v3 = json.loads((REPO / "results/cpu_study/mitigations/optimizer=adamw,seed=0,variant=1-step+stage_lr"
                     / "provenance.json").read_text())  # fmt: skip
    v4 = json.loads((REPO / "results/cpu_study/fixed/seed=0,variant=adamw_pipedream4+stage_lr"
                     / "provenance.json").read_text())  # fmt: skip
    assert revisions.of_record("compensation", "stage_lr", v3) == (1, "its commit 5344c72 lacks 262fe8d")
    assert revisions.of_record("compensation", "stage_lr", v4) == (2, "its commit 520539e contains 262fe8d")
    assert revisions.suffix("compensation", "stage_lr", v3)[0] == "@r1"
    assert revisions.suffix("compensation", "ef", v3) == ("", "")


def write_paci(root: Path, variant: str, seed: int, finals: list[tuple[int, float]], prov: dict | None) -> None:
    """A completed run of `variant` (sync, or PACI at P = 4 with per-stage clipping; `(x2)`: twice the steps)."""
    paci = variant != "sync"
    cfg = {
        "model": {"name": "tiny"},
        "data": {"name": "hamlet"},
        "seed": seed,
        "delay": int(paci),
        "engine": "simulate",
        "train": {"steps": 200 if "(x2)" in variant else 100, "micro_batches": 4},
        "pipeline": {"stages": 4, "clip": "stage", "schedule": "paci"} if paci else {"stages": 2},
        "optimizer": {"name": "adamw", "lr": 1e-3},
        "run": {"variant": variant},
    }
    name = f"{variant}-s{seed}"
    run = RunDir(root / name)
    run.write_config(yaml.safe_dump(cfg))
    for i, (tokens, loss) in enumerate(finals):
        run.append_metrics({"step": i, "tokens": tokens, "val_loss": loss})
    run.write_summary({"status": "completed", "final_val_loss": finals[-1][1], "tokens": finals[-1][0]})
    if prov is not None:
        (root / name / "provenance.json").write_text(json.dumps(prov))


def test_two_recipes_of_one_schedule_form_two_budget_ladders(tmp_path):
    """v5's recompute-recipe PACI records (no recorded revision, started before e5e0d61: paci r1) and today's
    in-place PACI (r2), each with a 1x and a 2x budget, merged with one sync sweep. Every setting is equal, yet the
    recipes are two ladders, each holding only its own runs and seeds: r1 reaches sync's loss halfway between its
    budgets (1.5x), r2 a quarter of the way (1.25x); pooled, seed 3 would mix both recipes' budgets."""
    old_prov = {"started": "2026-12-03T13:30:07", "git": {"commit": "0123456789abcdef0123", "dirty": False}}
    new_prov = {"revisions": {"schedule": {"name": "paci", "revision": 2}}}
    sweeps = {"ttt": ["sync"], "paci_old": ["PACI", "PACI(x2)"], "paci_new": ["PACI", "PACI(x2)"]}
    for name, variants in sweeps.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "sweep.json").write_text(json.dumps({"name": name, "variants": {v: [] for v in variants}}))
    for seed in (3, 4, 5):
        write_paci(tmp_path / "ttt", "sync", seed, [(2500, 3.5), (5000, 3.0 + 0.01 * seed)], None)
    recipes = (("paci_old", (3, 4), old_prov, -0.1), ("paci_new", (3, 5), new_prov, -0.3))
    for name, seeds, prov, longer in recipes:
        for seed in seeds:
            target = 3.0 + 0.01 * seed
            write_paci(tmp_path / name, "PACI", seed, [(2500, 3.6), (5000, target + 0.1)], prov)
            write_paci(tmp_path / name, "PACI(x2)", seed, [(5000, 3.5), (10000, target + longer)], prov)
    report = build_report([tmp_path / n for n in sweeps], out_dir=tmp_path / "out", plots=False, merge=True)
    by = {lad.columns[0]: lad for lad in report.ladders}
    assert set(by) == {"PACI@r1", "PACI"}, list(by)
    old, new = by["PACI@r1"], by["PACI"]
    assert old.columns == ["PACI@r1", "PACI(x2)@r1"] and new.columns == ["PACI", "PACI(x2)"]
    assert sorted(old.per_seed) == [3, 4] and sorted(new.per_seed) == [3, 5]
    assert (old.schedule, new.schedule) == ("paci-recompute", "paci")
    assert old.ratio.value == pytest.approx(1.5) and new.ratio.value == pytest.approx(1.25)
    names = list(tokens_table(report.ladders, report.bench)["variant (budgets)"])
    assert sorted(names) == ["PACI (1.00x, 2.00x budgets)", "PACI@r1 (1.00x, 2.00x budgets)"]
    assert any(w.startswith("paci@r1 ran schedule paci revision 1") for w in report.warnings)
