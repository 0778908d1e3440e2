"""Tests of asyncpipe.report on synthetic run dirs with known numbers (std is the sample std, ddof=1)."""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import pandas as pd
import pytest
import yaml

from asyncpipe.errors import UserError
from asyncpipe.report import build_report, build_report_from_wandb, log_report_to_wandb, render_terminal
from asyncpipe.track import RunDir

VARIANTS = {"sync": (0, False), "1-step": (1, False), "1-step+EF": (1, True)}
OPTIMIZERS = ["adamw", "muon"]
SEEDS = [0, 1, 2]
EVAL_TOKENS = [1000, 2000, 3000, 4000, 5000]


def config(opt: str, variant: str, seed: int, **over) -> dict:
    delay, ef = VARIANTS[variant]
    cfg = {
        "model": {"name": "tiny", "n_layer": 2},
        "data": {"name": "hamlet"},
        "tokenizer": {"name": "byte"},
        "optimizer": {"name": opt, "lr": {"adamw": 1e-3, "muon": 2e-2}[opt], "ef": {"enabled": ef, "lam": 1.0}},
        "delay": delay,
        "delay_profile": "uniform",
        "pipeline": {"stages": 2},
        "engine": "simulate",
        "seed": seed,
    }
    for dotted, value in over.items():
        node = cfg
        *parents, leaf = dotted.split("__")
        for p in parents:
            node = node[p]
        node[leaf] = value
    return cfg


def curve(final: float, tokens: list[int]) -> list[dict]:
    """Eval records whose val loss at 5000 tokens is `final` (higher earlier, lower later)."""
    return [
        {"step": i + 1, "tokens": t, "train_loss": 9.0, "val_loss": final + (5000 - t) / 1000 * 0.25}
        for i, t in enumerate(tokens)
    ]


def write_run(root: Path, name: str, cfg: dict, metrics: list[dict], summary: dict | None) -> None:
    run = RunDir(root / name)
    run.write_config(yaml.safe_dump(cfg))
    for rec in metrics:
        run.append_metrics(rec)
        run.append_metrics({"step": rec["step"], "tokens": rec["tokens"] + 10, "train_loss": 1.0})  # no eval line
    if summary is not None:
        run.write_summary(summary)


def finals() -> dict[tuple[str, str, int], float]:
    rng = random.Random(1234)
    base = {"adamw": 3.0, "muon": 2.8}
    offset = {"sync": 0.0, "1-step": 0.12, "1-step+EF": 0.05}
    return {
        (o, v, s): base[o] + offset[v] + rng.uniform(-0.03, 0.03) for o in OPTIMIZERS for v in VARIANTS for s in SEEDS
    }


@pytest.fixture
def sweep(tmp_path) -> Path:
    """2 optimizers x {sync, 1-step, 1-step+EF} x 3 seeds, one run past the common token count,
    plus a diverged and an unfinished run."""
    root = tmp_path / "sweeps" / "paper"
    root.mkdir(parents=True)
    (root / "sweep.json").write_text("{}")
    for (opt, variant, seed), final in finals().items():
        metrics = curve(final, EVAL_TOKENS)
        if (opt, variant, seed) == ("adamw", "sync", 1):  # trained longer: must be compared at 5000, not 6000
            metrics.append({"step": 6, "tokens": 6000, "train_loss": 1.0, "val_loss": final - 0.5})
        last = metrics[-1]
        summary = {"status": "completed", "final_val_loss": last["val_loss"], "tokens": last["tokens"], "wall_time": 1.0}
        write_run(root, f"{opt}-{variant}-s{seed}", config(opt, variant, seed), metrics, summary)
    diverged = {"status": "diverged", "tokens": 2000}
    write_run(root, "adamw-1-step-s3", config("adamw", "1-step", 3), curve(8.0, [1000, 2000]), diverged)
    write_run(root, "muon-1-step+EF-s3", config("muon", "1-step+EF", 3), curve(1.0, [1000, 2000, 3000]), None)
    return root


def expected_stats() -> dict[tuple[str, str], dict]:
    out = {}
    vals = finals()
    for opt in OPTIMIZERS:
        for variant in VARIANTS:
            xs = [vals[(opt, variant, s)] for s in SEEDS]
            out[(opt, variant)] = {"mean": statistics.fmean(xs), "std": statistics.stdev(xs), "n": len(xs)}
        sync = out[(opt, "sync")]["mean"]
        for variant in ("1-step", "1-step+EF"):
            out[(opt, variant)]["gap"] = out[(opt, variant)]["mean"] - sync
            pairs = [vals[(opt, variant, s)] - vals[(opt, "sync", s)] for s in SEEDS]
            out[(opt, variant)]["gap_std"] = statistics.stdev(pairs)
        g1, ge = out[(opt, "1-step")]["gap"], out[(opt, "1-step+EF")]["gap"]
        out[(opt, "1-step+EF")]["closed"] = (g1 - ge) / g1 * 100
    return out


T_975 = {1: 12.706204736174705, 2: 4.302652729911275}  # Student t 97.5th percentiles by degrees of freedom (tables)


def close(a: float, b: float) -> bool:
    return a == pytest.approx(b, rel=1e-12, abs=1e-12)


def test_table_numbers_match_inputs(sweep):
    report = build_report(sweep)
    assert len(report.groups) == 1
    group = report.groups[0]
    assert group.key == {"model.name": "tiny", "data.name": "hamlet"}
    assert report.group_keys == [] and report.grouping.row_keys == ["optimizer.lr"]
    assert report.grouping.variant_keys == ["delay", "optimizer.ef.enabled"]
    assert group.matched_tokens == 5000
    exp = expected_stats()
    cells = report.cells.set_index(["optimizer", "variant"])
    for (opt, variant), e in exp.items():
        c = cells.loc[(opt, variant)]
        assert c["n"] == e["n"] and close(c["mean"], e["mean"]) and close(c["std"], e["std"])
        if variant != "sync":
            assert close(c["gap_to_sync"], e["gap"]) and close(c["gap_std"], e["gap_std"])
        if variant == "1-step+EF":
            assert close(c["gap_closed_pct"], e["closed"])
    # The diverged and the unfinished run are counted in their cells, not averaged in.
    assert cells.loc[("adamw", "1-step"), "n_diverged"] == 1
    assert cells.loc[("muon", "1-step+EF"), "n_unfinished"] == 1
    table = group.table
    a1 = exp[("adamw", "1-step")]
    assert table.loc["adamw", "1-step"] == f"{a1['mean']:.4f} ± {a1['std']:.4f} (n=3; 1 diverged)"
    m_ef = exp[("muon", "1-step+EF")]
    assert table.loc["muon", "1-step+EF"] == f"{m_ef['mean']:.4f} ± {m_ef['std']:.4f} (n=3; 1 unfinished)"
    m1 = exp[("muon", "1-step")]
    half = T_975[2] * m1["gap_std"] / 3**0.5  # the gap's 95% paired t-interval over 3 seeds
    assert table.loc["muon", "gap 1-step"] == f"{m1['gap']:+.4f} [{m1['gap'] - half:+.4f}, {m1['gap'] + half:+.4f}]"
    closed = next(c.interval for c in report.claims if c.kind == "closed" and c.optimizer == "adamw")
    assert close(closed.value * 100, exp[("adamw", "1-step+EF")]["closed"])
    wide = closed.hi - closed.lo > 1  # wider than [0%, 100%]: its interval only, said to be not resolved
    shown = f"not resolved [{closed.lo:.0%}, " if wide else f"{exp[('adamw', '1-step+EF')]['closed']:.0f}% ["
    assert table.loc["adamw", "% gap closed 1-step+EF"].startswith(shown)
    statuses = report.runs.set_index("run")["status"]
    assert statuses["adamw-1-step-s3"] == "diverged" and statuses["muon-1-step+EF-s3"] == "unfinished"


def test_files_written(sweep):
    report = build_report(sweep)
    out = sweep / "report"
    assert report.out_dir == out
    assert sorted(p.name for p in out.iterdir()) == [
        "gap_vs_tokens.pdf", "gap_vs_tokens.png", "gaps.csv", "glance.pdf", "glance.png", "intervals.csv",
        "loss_curves.pdf", "loss_curves.png", "report.md",
    ]  # fmt: skip
    for name in ("loss_curves.png", "gap_vs_tokens.png"):  # one column per optimizer: 2 x 600 px wide
        assert matplotlib.image.imread(out / name).shape[:2] == (800, 1200)
        assert (out / name).with_suffix(".pdf").read_bytes().startswith(b"%PDF")
    csv = pd.read_csv(out / "gaps.csv").set_index(["optimizer", "variant"])
    exp = expected_stats()
    assert close(csv.loc[("muon", "1-step+EF"), "gap_closed_pct"], exp[("muon", "1-step+EF")]["closed"])
    assert (csv["matched_tokens"] == 5000).all()
    md = (out / "report.md").read_text()
    assert "**5000 tokens**" in md and "(loss_curves.png)" in md and "(gap_vs_tokens.png)" in md
    assert "1 diverged" in md and "1 unfinished" in md
    # Rebuilding ignores the report dir itself and gives the same numbers.
    again = build_report(sweep)
    pd.testing.assert_frame_equal(again.cells, report.cells)


def test_no_plots_writes_the_same_tables_without_images(sweep, tmp_path):
    full = build_report(sweep)
    tables = build_report(sweep, out_dir=tmp_path / "t", plots=False)
    assert sorted(p.name for p in (tmp_path / "t").iterdir()) == ["gaps.csv", "intervals.csv", "report.md"]
    pd.testing.assert_frame_equal(tables.cells, full.cells)
    md = (tmp_path / "t" / "report.md").read_text()
    assert "Not drawn" in md and ".png" not in md


def test_matched_tokens_follow_shortest_completed_run(tmp_path):
    """A group whose shortest completed run stops at 3000 tokens is compared at 3000 for every run."""
    finals_ = {("adamw", "sync", 0): 3.0, ("adamw", "1-step", 0): 3.2}
    write_run(tmp_path, "a", config("adamw", "sync", 0), curve(3.0, EVAL_TOKENS), {"status": "completed"})
    write_run(tmp_path, "b", config("adamw", "1-step", 0), curve(3.2, [1000, 2000, 3000]), {"status": "completed"})
    report = build_report(tmp_path)
    assert report.groups[0].matched_tokens == 3000
    cells = report.cells.set_index("variant")
    at3000 = {k: v + (5000 - 3000) / 1000 * 0.25 for k, v in finals_.items()}
    assert close(cells.loc["sync", "mean"], at3000[("adamw", "sync", 0)])
    assert close(cells.loc["1-step", "gap_to_sync"], at3000[("adamw", "1-step", 0)] - at3000[("adamw", "sync", 0)])
    assert report.groups[0].table.loc["adamw", "sync"] == f"{at3000[('adamw', 'sync', 0)]:.4f} (n=1)"


def test_sweep_without_ef_shows_dashes_and_setting_axes(tmp_path):
    vals = {}
    for lr in (1e-3, 3e-3):
        for variant in ("sync", "1-step"):
            for seed in (0, 1):
                final = 3.0 + (0.1 if variant == "1-step" else 0) + seed * 0.01 + lr
                vals[(lr, variant, seed)] = final
                cfg = config("adamw", variant, seed, optimizer__lr=lr)
                write_run(tmp_path, f"{lr}-{variant}-{seed}", cfg, curve(final, EVAL_TOKENS), {"status": "completed"})
    report = build_report(tmp_path, out_dir=tmp_path / "elsewhere")
    assert (tmp_path / "elsewhere" / "gaps.csv").exists()
    assert report.group_keys == ["optimizer.lr"]
    assert [g.key["optimizer.lr"] for g in report.groups] == [1e-3, 3e-3]
    for group in report.groups:
        lr = group.key["optimizer.lr"]
        row = group.table.loc["adamw"]
        assert not [c for c in row.index if "EF" in c], "a sweep without EF shows no empty EF columns"
        gap = statistics.fmean(vals[(lr, "1-step", s)] for s in (0, 1)) - statistics.fmean(
            vals[(lr, "sync", s)] for s in (0, 1)
        )
        pairs = [vals[(lr, "1-step", s)] - vals[(lr, "sync", s)] for s in (0, 1)]
        half = T_975[1] * statistics.stdev(pairs) / 2**0.5
        assert row["gap 1-step"] == f"{gap:+.4f} [{gap - half:+.4f}, {gap + half:+.4f}]"


def test_pipedream_profile_is_its_own_column(tmp_path):
    write_run(tmp_path, "s", config("adamw", "sync", 0), curve(3.0, EVAL_TOKENS), {"status": "completed"})
    cfg = config("adamw", "1-step", 0, delay_profile="pipedream", pipeline__stages=4)
    write_run(tmp_path, "p", cfg, curve(3.3, EVAL_TOKENS), {"status": "completed"})
    report = build_report(tmp_path)
    table = report.groups[0].table
    assert list(table.columns[:2]) == ["sync", "pipedream(P=4)"]
    assert table.loc["adamw", "gap pipedream(P=4)"] == f"{3.3 - 3.0:+.4f} (n=1)"  # one seed: no interval
    assert report.group_keys == []


def test_empty_and_missing_dirs_are_user_errors(tmp_path):
    (tmp_path / "sweep.json").write_text("{}")
    with pytest.raises(UserError, match="no runs found under"):
        build_report(tmp_path)
    with pytest.raises(UserError, match="not a directory"):
        build_report(tmp_path / "nope")


def test_render_terminal(sweep):
    from rich.console import Console

    console = Console(record=True, width=400)
    console.print(render_terminal(build_report(sweep, out_dir=sweep / "r")))
    text = console.export_text()
    assert "adamw" in text and "muon" in text and "5000 tokens" in text and "1 diverged" in text


class FakeRun:
    def __init__(self, run_dir: Path, wrapped: bool, job_type: str = "train"):
        cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
        self.config = {k: {"value": v} for k, v in cfg.items()} if wrapped else cfg
        summary = RunDir(run_dir).read_summary()
        self.summary = {"_runtime": 3, **summary} if summary else {"_runtime": 3}
        self.state = "finished" if summary else "running"
        self.name, self.id, self.url, self.job_type = run_dir.name, run_dir.name, "", job_type
        self._history = RunDir(run_dir).read_metrics()

    def scan_history(self, keys):
        return [{k: r[k] for k in keys} for r in self._history if all(r.get(k) is not None for k in keys)]


class FakeApi:
    def __init__(self, runs):
        self._runs, self.calls = runs, []

    def runs(self, path, filters=None):
        self.calls.append((path, filters))
        return self._runs


def test_report_from_wandb_matches_run_dirs(sweep, tmp_path):
    local = build_report(sweep, out_dir=tmp_path / "local")
    dirs = sorted(p for p in sweep.iterdir() if (p / "config.yaml").exists())
    fake = [FakeRun(d, wrapped=i % 2 == 0) for i, d in enumerate(dirs)]
    fake.append(FakeRun(dirs[0], wrapped=False, job_type="report"))  # the group's report run is skipped
    api = FakeApi(fake)
    remote = build_report_from_wandb("ent/proj", "paper", tmp_path / "remote", api=api)
    assert api.calls == [("ent/proj", {"group": "paper"})]
    cols = ["optimizer", "variant", "n", "mean", "std", "gap_to_sync", "gap_closed_pct", "n_diverged", "n_unfinished"]
    pd.testing.assert_frame_equal(remote.cells[cols], local.cells[cols])
    assert remote.groups[0].matched_tokens == 5000
    assert [len(t) for t in remote.runs["train"]] == [len(t) for t in local.runs["train"][: len(remote.runs)]]
    assert (tmp_path / "remote" / "loss_curves.png").exists()
    with pytest.raises(UserError, match="ENTITY/PROJECT"):
        build_report_from_wandb("proj", "paper", tmp_path / "x", api=api)
    with pytest.raises(UserError, match="no runs found"):
        build_report_from_wandb("ent/proj", "other", tmp_path / "x", api=FakeApi([]))


def test_log_report_to_wandb(sweep, tmp_path, monkeypatch):
    import wandb

    report = build_report(sweep)
    logged, finished = [], []

    class Run:
        step = 0

        def log(self, values, step=None):
            logged.append(values)

        def save(self, path, base_path=None, policy=None):
            logged.append({"file": Path(path).name})

        def finish(self, exit_code=0):
            finished.append(exit_code)

    inits = []
    monkeypatch.setattr(wandb, "init", lambda **kw: inits.append(kw) or Run())
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    cfg = {"tracker": {"wandb": {"mode": "disabled", "project": "p", "group": "paper", "tags": []}}}
    assert log_report_to_wandb(report, cfg) is False and inits == []
    cfg["tracker"]["wandb"]["mode"] = "offline"
    assert log_report_to_wandb(report, cfg) is True
    init = inits[0]
    assert (init["job_type"], init["group"], init["dir"]) == ("report", "paper", str(sweep / "report.wandb"))
    assert report.wandb_message.startswith("wrote an offline W&B run of the report to ")  # never "logged" offline
    assert not (sweep / "report" / "wandb").exists()
    table = logged[0]["loss_gaps"]
    assert len(table.data) == len(report.cells) == 6
    assert {"loss_curves", "gap_vs_tokens", "glance"} <= set(logged[1])
    assert {"report.md", "gaps.csv", "intervals.csv", "loss_curves.pdf", "gap_vs_tokens.pdf", "glance.pdf"} == {
        d["file"] for d in logged[2:]}  # fmt: skip
    assert finished == [0]


def test_report_never_imports_torch(sweep):
    code = (
        "import sys; from pathlib import Path; from asyncpipe.report import build_report;"
        f"build_report(Path({str(sweep)!r}), Path({str(sweep / 'r2')!r}));"
        "bad = [m for m in ('torch', 'deepspeed') if m in sys.modules]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


# --- grouping that cannot lie ------------------------------------------------------------------------------


def test_runs_differing_in_an_unlisted_key_are_never_pooled(tmp_path):
    """Weight decay and step count are not in any list of axes: they still split the runs, and no cell pools
    runs that differ in them (all these runs share seed 0)."""
    finals_ = {}
    for wd in (0.0, 0.1):
        for variant in ("sync", "1-step"):
            final = 3.0 + wd + (0.2 if variant == "1-step" else 0.0)
            finals_[(wd, 100, variant)] = final
            write_run(tmp_path, f"wd{wd}-{variant}", config("adamw", variant, 0, optimizer__weight_decay=wd),
                      curve(final, EVAL_TOKENS), {"status": "completed"})  # fmt: skip
    cfg = config("adamw", "sync", 0, optimizer__weight_decay=0.1, train={"steps": 50})
    write_run(tmp_path, "steps50", cfg, curve(3.7, EVAL_TOKENS), {"status": "completed"})
    report = build_report(tmp_path)
    assert report.group_keys == ["optimizer.weight_decay", "train.steps"]
    assert (report.cells["n"] <= 1).all()  # every run alone in its cell: nothing averaged
    assert len(report.groups) == 3 and sorted(len(g.runs) for g in report.groups) == [1, 2, 2]
    by_wd = {(g.key["optimizer.weight_decay"], g.key["train.steps"]): g for g in report.groups}
    for wd in (0.0, 0.1):
        row = by_wd[(wd, 100)].table.loc["adamw"]  # the schema default, for configs without the key
        assert row["gap 1-step"] == f"{finals_[(wd, 100, '1-step')] - finals_[(wd, 100, 'sync')]:+.4f} (n=1)"
    assert by_wd[(0.1, 50)].table.loc["adamw", "sync"] == "3.7000 (n=1)"
    md = (tmp_path / "report" / "report.md").read_text()
    assert "Tables split by: `optimizer.weight_decay`, `train.steps`" in md


def test_runs_sharing_a_seed_and_every_setting_are_shown_apart(tmp_path):
    for i, final in enumerate((3.0, 3.1)):  # the same run twice (only the ignored data.root differs)
        cfg = config("adamw", "sync", 0)
        cfg["data"]["root"] = f"/cache{i}"
        write_run(tmp_path, f"copy{i}", cfg, curve(final, EVAL_TOKENS), {"status": "completed"})
    write_run(tmp_path, "other", config("adamw", "sync", 1), curve(3.5, EVAL_TOKENS), {"status": "completed"})
    report = build_report(tmp_path)
    cell = report.cells.set_index("variant").loc["sync"]
    assert cell["n"] == 3 and pd.isna(cell["mean"]) and pd.isna(cell["std"])
    text = report.groups[0].table.loc["adamw", "sync"]
    assert text.startswith("not averaged") and "seed 0: 3.0000 (copy0), 3.1000 (copy1)" in text
    assert any("shown apart, not averaged" in w for w in report.warnings)
    assert "shown apart, not averaged" in (tmp_path / "report" / "report.md").read_text()


def test_named_variants_are_columns_in_file_order(tmp_path):
    """A sweep file's variants name the columns, in file order; the first is the gaps' reference; the keys they
    set are named as the columns' keys, and per-optimizer lrs are row settings, not table splits."""
    variants = {"sync": (0, False), "1-step": (1, False), "1-step+EF": (1, True)}
    (tmp_path / "sweep.json").write_text('{"name": "s", "variants": {"sync": [], "1-step+EF": [], "1-step": []}}')
    vals = {}
    for opt, lr in (("adamw", 3e-3), ("muon", 1e-2)):
        for name, (delay, ef) in variants.items():
            for seed in (0, 1):
                final = 3.0 + delay * 0.3 - ef * 0.1 + seed * 0.01
                vals[(opt, name, seed)] = final
                cfg = config(opt, name, seed, optimizer__lr=lr)
                cfg["run"] = {"variant": name, "dir": f"/x/{opt}{name}{seed}"}
                write_run(tmp_path, f"{opt}-{name}-{seed}", cfg, curve(final, EVAL_TOKENS), {"status": "completed"})
    report = build_report(tmp_path)
    assert report.grouping.named_variants and report.group_keys == []
    assert report.grouping.variant_keys == ["delay", "optimizer.ef.enabled"]
    assert report.grouping.row_keys == ["optimizer.lr"]
    table = report.groups[0].table
    assert list(table.columns[:4]) == ["settings", "sync", "1-step+EF", "1-step"]
    assert table.loc["adamw", "settings"] == "lr=0.003"
    # Both seeds close exactly 1/3, but two seeds cannot bound a ratio whose denominator (the gap) varies this much:
    # Fieller's interval (t_1 = 12.7) is unbounded, and the report says so instead of a false [33%, 33%] (with no
    # point value: an interval wider than [0%, 100%] is not resolved, never a percentage).
    assert table.loc["muon", "% gap closed 1-step+EF"] == "not resolved [unbounded]"
    diffs = report.cells.set_index(["optimizer", "variant"]).loc[("muon", "1-step+EF")]
    assert diffs["base_variant"] == "1-step" and close(diffs["diff_to_base"], -0.1)


def test_a_folder_of_several_sweeps_measures_gaps_against_sync(tmp_path):
    """Two sweeps in one folder: the reference is sync, not the first variant of whichever sweep sorts first."""
    for sweep, variants in (("a_depth", {"pipedream": (2, False)}), ("b_main", {"sync": (0, False), "1-step": (1, False)})):
        (tmp_path / sweep).mkdir()
        (tmp_path / sweep / "sweep.json").write_text(json.dumps({"name": sweep, "variants": {v: [] for v in variants}}))
        for name, (delay, ef) in variants.items():
            cfg = config("adamw", "sync", 0, delay=delay)
            cfg["run"] = {"variant": name, "dir": f"/x/{sweep}/{name}"}
            write_run(tmp_path / sweep, name, cfg, curve(3.0 + 0.1 * delay, EVAL_TOKENS), {"status": "completed"})
    table = build_report(tmp_path).groups[0].table
    assert list(table.columns[:3]) == ["sync", "pipedream", "1-step"]
    assert table.loc["adamw", "gap pipedream"] == "+0.2000 (n=1)" and table.loc["adamw", "gap 1-step"] == "+0.1000 (n=1)"


def test_cut_off_metrics_line_is_named(tmp_path):
    write_run(tmp_path, "a", config("adamw", "sync", 0), curve(3.0, EVAL_TOKENS), {"status": "completed"})
    with open(tmp_path / "a" / "metrics.jsonl", "a") as f:
        f.write('{"step": 9, "tokens": 90')
    report = build_report(tmp_path)
    assert any(w.startswith("run a: last line of metrics.jsonl is cut off") and "ignored" in w for w in report.warnings)
    assert report.groups[0].matched_tokens == 5000


def test_two_sweeps_compared_against_a_baseline(tmp_path):
    """`report B --baseline A`: B's columns are gapped against A's sync runs of the same seed."""
    base, other = tmp_path / "base", tmp_path / "depth"
    for root, name in ((base, "base"), (other, "depth")):
        root.mkdir()
        (root / "sweep.json").write_text(f'{{"name": "{name}"}}')
    for seed in (0, 1):
        write_run(base, f"sync{seed}", config("muon", "sync", seed), curve(3.0 + seed * 0.1, EVAL_TOKENS),
                  {"status": "completed"})  # fmt: skip
        for p in (2, 4):
            cfg = config("muon", "1-step", seed, delay_profile="pipedream", pipeline__stages=p)
            write_run(other, f"p{p}s{seed}", cfg, curve(3.0 + seed * 0.1 + p * 0.05 + seed * 0.01, EVAL_TOKENS),
                      {"status": "completed"})  # fmt: skip
    report = build_report(other, baseline=base)
    table = report.groups[0].table
    assert list(table.columns[:3]) == ["base:sync", "depth:pipedream(P=2)", "depth:pipedream(P=4)"]
    assert report.groups[0].reference == "base:sync"
    pairs = [0.2, 0.21]
    mean, half = statistics.fmean(pairs), T_975[1] * statistics.stdev(pairs) / 2**0.5
    assert table.loc["muon", "gap depth:pipedream(P=4)"] == f"{mean:+.4f} [{mean - half:+.4f}, {mean + half:+.4f}]"
    assert report.out_dir == tmp_path / "report-base-vs-depth"
    # PipeDream P=4 against P=2, same seed: --reference names the column.
    vs = build_report(other, out_dir=tmp_path / "vs", baseline=base, reference="depth:pipedream(P=2)").groups[0].table
    assert vs.loc["muon", "gap depth:pipedream(P=4)"] == "+0.1000 [+0.1000, +0.1000]"  # both seeds +0.1 exactly
    half = T_975[1] * statistics.stdev([-0.1, -0.11]) / 2**0.5
    assert vs.loc["muon", "gap base:sync"] == f"{-0.105:+.4f} [{-0.105 - half:+.4f}, {-0.105 + half:+.4f}]"
    with pytest.raises(UserError, match="not a column"):
        build_report(other, out_dir=tmp_path / "x", reference="sync")


def test_wandb_report_run_has_its_own_config_and_tags(sweep):
    from asyncpipe.report import report_run_config
    from asyncpipe.track.wandb_mirror import derive_tags

    (sweep / "sweep.json").write_text('{"name": "paper", "base_overrides": ["train.steps=5"], "grid": {"seed": ["0"]}}')
    cfg = report_run_config(build_report(sweep))
    assert derive_tags(cfg) == ["report", "sweep:paper"]  # never a training run's opt:/delay: tags
    assert cfg["report"]["sweeps"][0]["grid"] == {"seed": ["0"]} and cfg["report"]["runs"] == 20
    assert cfg["report"]["variant_keys"] == ["delay", "optimizer.ef.enabled"]
    assert cfg["tracker"]["wandb"]["group"] == "paper" and "optimizer" not in cfg


def test_piped_report_never_cuts_headers(sweep):
    import io

    from asyncpipe.report import print_report

    out = io.StringIO()  # not a terminal, as when piped into a file or `less`
    print_report(build_report(sweep, out_dir=sweep / "r"), out)
    text = out.getvalue()
    assert "% gap closed 1-step+EF" in text and "gap 1-step+EF" in text and "…" not in text


def test_gap_plot_points_are_paired_per_seed_differences(sweep):
    from asyncpipe.report.plots import paired_gap, smoothed_train

    report = build_report(sweep, out_dir=sweep / "r")
    runs = report.runs[report.runs["status"] == "completed"]
    muon = runs[runs["optimizer"] == "muon"]
    gap = paired_gap(report.curves, muon[muon["variant"] == "1-step"], muon[muon["variant"] == "sync"])
    exp = expected_stats()[("muon", "1-step")]
    assert list(gap.index) == EVAL_TOKENS and (gap["n"] == 3).all()
    assert close(gap.loc[5000, "mean"], exp["gap"]) and close(gap.loc[5000, "std"], exp["gap_std"])
    train = smoothed_train(muon[muon["variant"] == "sync"])
    assert len(train) == 2 * len(EVAL_TOKENS) and close(train.iloc[0], 9.0) and train.iloc[-1] < 9.0  # EMA of 9, 1, 9, …


def test_report_lists_code_states_and_warns_when_they_differ(tmp_path):
    for i, commit in enumerate(("a" * 40, "b" * 40)):
        write_run(tmp_path, f"r{i}", config("adamw", "sync", i), curve(3.0, EVAL_TOKENS), {"status": "completed"})
        prov = {"git": {"commit": commit, "dirty": i == 1}, "versions": {"asyncpipe": "0.1.0", "torch": "2.13.0"}}
        (tmp_path / f"r{i}" / "provenance.json").write_text(json.dumps(prov))
    report = build_report(tmp_path)
    assert any("2 different code states" in w for w in report.warnings)
    md = (tmp_path / "report" / "report.md").read_text()
    assert "| aaaaaaaaaa; asyncpipe 0.1.0; torch 2.13.0 | 1 | no |" in md
    assert "| bbbbbbbbbb (dirty); asyncpipe 0.1.0; torch 2.13.0 | 1 | yes: uncommitted changes |" in md
    assert "1 of 2 runs came from a working tree with uncommitted changes" in md
    assert "covers seed-to-seed variation only" in md and "not cover numerical differences between machines" in md


def test_a_one_seed_cell_is_paired_with_the_same_seed_of_a_three_seed_reference(tmp_path):
    """The gap of a 1-seed run (a lambda probe, say) is to the same seed's sync run, not to the mean of three."""
    sync = {0: 3.00, 1: 3.30, 2: 3.60}
    for seed, final in sync.items():
        done = {"status": "completed"}
        write_run(tmp_path, f"sync-s{seed}", config("adamw", "sync", seed), curve(final, EVAL_TOKENS), done)
    write_run(tmp_path, "late-s0", config("adamw", "1-step", 0), curve(3.10, EVAL_TOKENS), {"status": "completed"})
    cells = build_report(tmp_path).cells.set_index("variant")
    assert close(cells.loc["1-step", "gap_to_sync"], 0.10)  # unpaired it would be 3.10 - 3.30 = -0.20


def test_gap_plot_draws_only_tables_with_a_reference_and_another_column(tmp_path, monkeypatch):
    """An lr grid's edge run without its sync partner (study v5's Muon 0.0025) is a table with no gap: no empty
    panel for it. With no gap anywhere, no gap figure at all, and report.md does not point at one."""
    import report_runs

    from asyncpipe.report import plots

    root = report_runs.sweep(tmp_path / "s", "s", ["sync", "1-step"])
    for seed in range(2):
        for variant, lr in (("sync", 0.01), ("1-step", 0.01), ("1-step", 0.0025)):
            report_runs.write(root, variant, "muon", seed, report_runs.line(3.0 + 0.1 * (variant != "sync")), lr=lr,
                              name=f"{variant}-lr{lr}-s{seed}")  # fmt: skip
    panels: list[int] = []
    real = plots._figure
    monkeypatch.setattr(plots, "_figure", lambda n: (panels.append(n), real(n))[1])
    report = build_report(root, out_dir=tmp_path / "out", plots=True)
    assert len(report.groups) == 2 and panels == [2, 1]  # loss curves: both tables; gaps: the table with sync only
    only_async = report_runs.sweep(tmp_path / "a", "a", ["sync", "1-step"])
    report_runs.write(only_async, "1-step", "muon", 0, report_runs.line(3.1))
    report = build_report(only_async, out_dir=tmp_path / "out2", plots=True)
    md = (tmp_path / "out2" / "report.md").read_text()
    assert "gap_vs_tokens.png" not in report.files and "gap_vs_tokens" not in md and "(loss_curves.png)" in md


def test_the_gap_zoom_ends_where_the_gaps_do(tmp_path, monkeypatch):
    """A delayed run longer than its reference (a longer budget: 10,000 tokens against sync's 5,000) has no gap past
    5,000, so the gap figure's zoomed row spans the last 30% up to 5,000, not empty space up to 10,000; the loss
    curves' zoom still spans every curve."""
    import report_runs

    from asyncpipe.report import plots

    root = report_runs.sweep(tmp_path / "s", "s", ["sync", "1-step"])
    for seed in range(2):
        report_runs.write(root, "sync", "adamw", seed, report_runs.line(3.0))
        report_runs.write(root, "1-step", "adamw", seed, report_runs.line(3.2, end=10000))
    spans: list[tuple[float, float]] = []
    real = plots._zoom_limits
    monkeypatch.setattr(
        plots, "_zoom_limits", lambda ax, lo, hi, *a, **k: (spans.append((lo, hi)), real(ax, lo, hi, *a, **k))
    )
    build_report(root, out_dir=tmp_path / "out", plots=True)
    assert spans[0] == (pytest.approx(7000.0), 10000.0)  # loss curves: every curve
    assert spans[-1] == (pytest.approx(3500.0), 5000.0)  # gaps: where sync's pairs end
