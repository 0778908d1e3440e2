"""What a report judges against and which number it states: the paper's own targets (`--target paper`), one
throughput per time-to-target claim, on synthetic run dirs with known numbers."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.pyplot as plt
import pytest
import yaml
from typer.testing import CliRunner

from asyncpipe.cli import app
from asyncpipe.cli import main as cli_main
from asyncpipe.report import build_report, paper
from asyncpipe.report.target import speedup_table, tokens_table
from asyncpipe.track import RunDir

import report_runs
from report_runs import line, sweep


def write(root: Path, variant: str, opt: str, seed: int, finals: list[tuple[int, float]], steps: int = 100,
          lr: float = 1e-3) -> None:  # fmt: skip
    """A completed run of `variant` in ROOT/{opt}-{variant}-lr{lr}-s{seed}."""
    report_runs.write(root, variant, opt, seed, finals, steps, lr, name=f"{opt}-{variant}-lr{lr}-s{seed}")



def test_the_papers_targets_are_derived_from_its_table():
    adamw, muon = paper.row("adamw"), paper.row("muon")
    assert (adamw.sync, adamw.one_step, adamw.ef) == (2.612, 2.890, 2.640)
    assert adamw.closure == pytest.approx((2.890 - 2.640) / (2.890 - 2.612))  # 0.899
    assert muon.closure == pytest.approx((2.590 - 2.583) / (2.590 - 2.578))  # 0.583
    assert round(adamw.closure * 100) == 90 and round(muon.closure * 100) == 58
    assert paper.gap_ratio("adamw", "muon") == pytest.approx(0.278 / 0.012)  # 23.2x
    assert paper.row("muon", "moe_10b").model == "MoE-10B" and paper.row("nadam") is None
    assert paper.goal("paper", "nadam") is None and paper.goal(0.85, "nadam").name() == "the 85% target"


def test_target_paper_judges_each_optimizer_against_its_own_figure(tmp_path):
    """AdamW's EF closes 70% (per seed 0.28/0.4, 0.3/0.4, 0.26/0.4: clear of the paper's 90%); Muon's closes 60%
    [20%, 103%] (consistent with the paper's 58%; no wider than [0%, 100%], so judged); AdamW's gap over Muon's,
    0.4 / 0.05 = 8x with a tight interval, is below the paper's 23.2x."""
    root = sweep(tmp_path / "s", "s", ["sync", "1-step", "1-step+EF"])
    for seed, (a_ef, m_ef) in enumerate([(0.12, 0.012), (0.10, 0.03), (0.14, 0.02)]):
        for opt, gap, ef_gap in (("adamw", 0.4, a_ef), ("muon", 0.05 + 0.002 * seed, m_ef)):
            write(root, "sync", opt, seed, line(3.0 + 0.01 * seed))
            write(root, "1-step", opt, seed, line(3.0 + 0.01 * seed + gap))
            write(root, "1-step+EF", opt, seed, line(3.0 + 0.01 * seed + ef_gap))
    report = build_report(root, out_dir=tmp_path / "out", plots=False, target="paper")
    adamw, muon = report.takeaways[0], report.takeaways[1]
    assert "1-step+EF recovers 70% [" in adamw and "(short of the paper's 90% for adamw)" in adamw
    assert "(consistent with the paper's 58% for muon: not resolved vs 58% (3 seeds;" in muon
    ratio = next(t for t in report.takeaways if t.startswith("1-step: adamw's gap / muon's"))
    assert ratio.endswith(", below the paper's 23.2x (adamw / muon 1-step gap).")
    md = (tmp_path / "out" / "report.md").read_text()
    assert "## Targets: the paper's own figures" in md and "2.612 / 2.890 / 2.640" in md and "EF closes 90%" in md
    assert "--target paper" in md  # the regenerate command


def test_target_is_a_percentage_or_paper_else_one_line(tmp_path, capsys):
    root = sweep(tmp_path / "s", "s", ["sync", "1-step"])
    for seed in range(2):
        write(root, "sync", "adamw", seed, line(3.0))
        write(root, "1-step", "adamw", seed, line(3.2))
    for bad in ("ninety", "0", "150"):
        with pytest.raises(SystemExit) as exit_:
            cli_main(["report", str(root), "--target", bad, "--out", str(tmp_path / "o"), "--no-plots"])
        err = capsys.readouterr().err.strip().splitlines()
        assert exit_.value.code == 2 and len(err) == 1 and "--target" in err[0] and "'paper'" in err[0]
    res = CliRunner().invoke(app, ["report", str(root), "--target", "paper", "--out", str(tmp_path / "o"),
                                   "--no-plots", "--no-wandb-log"])  # fmt: skip
    assert res.exit_code == 0, res.output


def test_takeaway_tables_and_wallclock_plot_state_one_throughput_per_ladder(tmp_path, monkeypatch):
    """An EF ladder at P=2, m=4 with a bench file measuring 2BW 1.25x and 2BW+EF 1.20x: the takeaway, the
    time-to-target table, the speed-up table's own row and the wall-clock plot's legend all use 1.20 (measured),
    so they state the same net speed-up (about 1.20 / 1.5 = 0.80x)."""
    main = sweep(tmp_path / "main", "main", ["sync", "1-step+EF"])
    longer = sweep(tmp_path / "longer", "longer", ["1-step+EF(x2)"])
    for seed in range(3):
        L = 3.0 + 0.01 * seed
        write(main, "sync", "adamw", seed, line(L))
        write(main, "1-step+EF", "adamw", seed, line(L + 0.2))
        write(longer, "1-step+EF(x2)", "adamw", seed, line(L - 0.2 + 0.01 * seed, 10000), steps=200)
    bench = tmp_path / "b.json"
    bench.write_text(json.dumps({"stages": 2, "micro_batches": 4, "optimizer": "adamw", "variants": {
        "1f1b": {"ratio_to_1f1b": 1.0}, "2bw": {"ratio_to_1f1b": 1.25, "ratio_to_1f1b_per_round": [1.24, 1.25, 1.26]},
        "2bw_ef": {"ratio_to_1f1b": 1.2, "ratio_to_1f1b_per_round": [1.19, 1.2, 1.21]}}}))  # fmt: skip
    drawn = []
    monkeypatch.setattr("asyncpipe.report.wallclock.save_figure", lambda fig, path: drawn.append(fig) or [])
    report = build_report(longer, out_dir=tmp_path / "o", baseline=main, bench=[bench])
    (lad,) = report.ladders
    net = lad.net(lad.throughput(report.bench))
    assert lad.throughput(report.bench).vs_1f1b == 1.2 and net.startswith(f"{1.2 / lad.ratio.value:.2f}x [")
    said = next(t for t in report.takeaways if t.startswith("adamw"))
    assert "(1.20x throughput, measured, 3 rounds)" in said and f"net speed-up {net}" in said
    row = tokens_table(report.ladders, report.bench).iloc[0]
    assert row["net speed-up at its P, m"] == f"{net} (P=2, m=4: 1.200x throughput, measured, 3 rounds)"
    own = speedup_table(report.ladders, report.bench).loc[(2, 4)]
    assert own["adamw main:1-step+EF vs 1F1B"] == f"{net} (1.200, measured, 3 rounds)"
    ideal = speedup_table(report.ladders, report.bench).loc[(4, 4)]
    assert ideal["adamw main:1-step+EF vs 1F1B"].endswith("(1.750, ideal (m+P-1)/m)")
    legend = [t.get_text() for ax in drawn[0].axes for t in ax.get_legend().get_texts()]
    assert any("÷1.200, measured at P=2, m=4" in t for t in legend), legend
    plt.close("all")
    md = (tmp_path / "o" / "report.md").read_text()
    assert md.count(net) >= 3  # the takeaway and both tables


def test_a_paci_ladder_is_timed_by_pacis_throughput_not_2bws(tmp_path):
    """A PACI column (pipeline.schedule=paci, P=4, m=4) beside 2BW's: each ladder's net speed-up uses its own
    schedule's throughput. A bench file measuring 2BW and 2BW+EF but not PACI measures nothing for PACI: PACI at
    P=2 is not 'measured' with 2BW's 1.25x."""
    root = sweep(tmp_path / "s", "s", ["sync", "1-step", "PACI"])
    for seed in range(3):
        L = 3.0 + 0.01 * seed
        for variant, loss, extra in (("sync", L, {}), ("1-step", L - 0.05, {}),
                                     ("PACI", L - 0.1, {"schedule": "paci", "stages": 4, "clip": "stage"})):  # fmt: skip
            cfg = {"model": {"name": "tiny"}, "data": {"name": "hamlet"}, "seed": seed,
                   "delay": int(variant != "sync"), "engine": "simulate", "train": {"steps": 100, "micro_batches": 4},
                   "pipeline": {"stages": 2, **extra}, "optimizer": {"name": "adamw", "lr": 1e-3},
                   "run": {"variant": variant}}  # fmt: skip
            run = RunDir(root / f"{variant}-s{seed}")
            run.write_config(yaml.safe_dump(cfg))
            for i, (tokens, val) in enumerate(line(loss, 10000 if variant != "sync" else 5000)):
                run.append_metrics({"step": i, "tokens": tokens, "val_loss": val})
            run.write_summary({"status": "completed", "final_val_loss": loss, "tokens": 10000})
            if variant == "PACI":  # what a run records of the schedule it ran (today's paci: revision 2)
                prov = {"revisions": {"schedule": {"name": "paci", "revision": 2}}}
                (root / f"{variant}-s{seed}" / "provenance.json").write_text(json.dumps(prov))
    bench = tmp_path / "b.json"
    bench.write_text(json.dumps({"stages": 2, "micro_batches": 4, "variants": {
        "1f1b": {"ratio_to_1f1b": 1.0}, "2bw": {"ratio_to_1f1b": 1.25}, "2bw_ef": {"ratio_to_1f1b": 1.2}}}))
    report = build_report(root, out_dir=tmp_path / "o", plots=False, bench=[bench])
    by = {lad.columns[0]: lad for lad in report.ladders}
    assert (by["PACI"].schedule, by["PACI"].stages, by["1-step"].schedule) == ("paci", 4, "2bw")
    assert by["1-step"].throughput(report.bench).source.startswith("measured, 2bw")
    paci = by["PACI"].throughput(report.bench)
    assert paci.kind == "ideal (m+P-1)/m" and paci.vs_1f1b == pytest.approx(7 / 4)  # P=4: no file, no timings
    from asyncpipe.report.throughput import throughput

    assert throughput(2, 4, report.bench, schedule="paci").kind == "ideal (m+P-1)/m"  # 2BW's file is not PACI's
    bench.write_text(json.dumps({"stages": 2, "micro_batches": 4, "variants": {
        "1f1b": {"ratio_to_1f1b": 1.0}, "2bw": {"ratio_to_1f1b": 1.25}, "paci": {"ratio_to_1f1b": 1.1}}}))
    again = build_report(root, out_dir=tmp_path / "o2", plots=False, bench=[bench])
    assert throughput(2, 4, again.bench, schedule="paci").source == "measured, paci (b.json)"
    # Records of paci's revision 1 (the recompute recipe) are named apart and timed as today's paci-recompute.
    for seed in range(3):
        prov = {"revisions": {"schedule": {"name": "paci", "revision": 1}}}
        (root / f"PACI-s{seed}" / "provenance.json").write_text(json.dumps(prov))
    old = build_report(root, out_dir=tmp_path / "o3", plots=False, bench=[bench])
    by = {lad.columns[0]: lad for lad in old.ladders}
    assert "PACI" not in by and by["PACI@r1"].schedule == "paci-recompute"
    assert any("PACI@r1" in w or "paci@r1" in w for w in old.warnings)


def test_best_of_compares_each_column_at_its_own_best_lr_chosen_on_other_seeds(tmp_path):
    """lr 0.001 / 0.004 / 0.016 x {sync, 1-step} x seeds 0-3. Sync is best at 0.016, 1-step at 0.004 (at 0.016 its
    seed-0 run diverged: not eligible). Chosen on seeds 0, 1 (the lower half), measured on 2, 3, where each value
    is offset by +0.1 per seed so a number from a selection seed would show."""
    root = sweep(tmp_path / "s", "s", ["sync", "1-step"])
    loss = {("sync", 0.001): 3.2, ("sync", 0.004): 3.05, ("sync", 0.016): 3.0,
            ("1-step", 0.001): 3.3, ("1-step", 0.004): 3.15, ("1-step", 0.016): 3.1}  # fmt: skip
    for (variant, lr), base in loss.items():
        for seed in range(4):
            name = f"{variant}-lr{lr}-s{seed}"
            cfg = {"model": {"name": "tiny"}, "data": {"name": "hamlet"}, "seed": seed, "delay": int(variant != "sync"),
                   "engine": "simulate", "optimizer": {"name": "adamw", "lr": lr, "ef": {"enabled": False, "lam": 1.0}},
                   "run": {"variant": variant}}  # fmt: skip
            run = RunDir(root / name)
            run.write_config(yaml.safe_dump(cfg))
            final = base + 0.1 * seed + (0.01 if seed == 3 and variant == "1-step" else 0.0)
            run.append_metrics({"step": 1, "tokens": 1000, "val_loss": final})
            diverged = (variant, lr, seed) == ("1-step", 0.016, 0)
            status = "diverged" if diverged else "completed"
            run.write_summary({"status": status, "final_val_loss": final, "tokens": 1000})
    report = build_report(root, out_dir=tmp_path / "out", plots=False, best_of="optimizer.lr")
    first = report.takeaways[0]
    assert first.startswith("Tuned against tuned: each column at its own best `optimizer.lr` (chosen on seed(s) 0, 1, "
                            "measured on seed(s) 2, 3")
    assert "adamw sync lr=0.016" in first and "adamw 1-step lr=0.004" in first
    (group,) = report.groups  # lr no longer splits the tables
    row = group.table.loc["adamw"]
    assert row["sync"] == "3.2500 ± 0.0707 (n=2, lr=0.016)" and row["1-step"].endswith("(n=2, lr=0.004)")
    gap = next(c for c in report.claims if c.kind == "gap")
    assert gap.interval.n == 2 and gap.interval.value == pytest.approx(0.155)  # (0.15 + 0.16) / 2 at seeds 2, 3
    selection = report.tuning.table.set_index("column")
    assert selection.loc["1-step", "0.016"] == "incomplete" and selection.loc["sync", "0.016"] == "3.0500"
    md = (tmp_path / "out" / "report.md").read_text()
    assert "## Tuned against tuned: `optimizer.lr`" in md and "--best-of optimizer.lr" in md
    chosen = build_report(root, out_dir=tmp_path / "o2", plots=False, best_of="optimizer.lr", select_seeds=["3"])
    assert "chosen on seed(s) 3, measured on seed(s) 0, 1, 2" in chosen.takeaways[0]


def test_best_of_keeps_runs_recorded_before_a_key_existed_in_their_column(tmp_path):
    """Study v5's records: the lr grid's first runs predate `train.deterministic`, its later ones (a grid edge, a
    missing seed) record it at its default. They are one column (the key at its default is what the older runs
    ran), so each column still gets exactly one chosen lr and its measurement seeds are averaged, not shown apart."""
    root = sweep(tmp_path / "s", "s", ["sync", "1-step"])
    for variant, lr, seed, final in [("sync", 0.004, 0, 3.0), ("sync", 0.004, 1, 3.1), ("sync", 0.008, 0, 3.2),
                                     ("sync", 0.008, 1, 3.3), ("1-step", 0.004, 0, 3.4), ("1-step", 0.004, 1, 3.5),
                                     ("1-step", 0.002, 0, 3.3), ("1-step", 0.002, 1, 3.45)]:  # fmt: skip
        cfg = {"model": {"name": "tiny"}, "data": {"name": "hamlet"}, "seed": seed, "delay": int(variant != "sync"),
               "engine": "simulate", "optimizer": {"name": "adamw", "lr": lr, "ef": {"enabled": False, "lam": 1.0}},
               "run": {"variant": variant}}  # fmt: skip
        if lr == 0.002 or (lr == 0.008 and seed == 1):  # recorded after the schema gained the key
            cfg["train"] = {"deterministic": False}
        run = RunDir(root / f"{variant}-lr{lr}-s{seed}")
        run.write_config(yaml.safe_dump(cfg))
        run.append_metrics({"step": 1, "tokens": 1000, "val_loss": final})
        run.write_summary({"status": "completed", "final_val_loss": final, "tokens": 1000})
    report = build_report(root, out_dir=tmp_path / "out", plots=False, best_of="optimizer.lr", select_seeds=["0"])
    assert sorted(report.tuning.table[["column", "chosen"]].values.tolist()) == [["1-step", "0.002"], ["sync", "0.004"]]
    (group,) = report.groups
    assert group.table.loc["adamw", "1-step"].endswith("(n=1, lr=0.002)")
    gap = next(c for c in report.claims if c.kind == "gap")
    assert gap.interval.value == pytest.approx(3.45 - 3.1)


def test_best_of_value_columns_ascend_by_number_whatever_order_the_runs_come_in(tmp_path):
    """The selection table's value columns are one ascending numeric axis. The first column read (1-step: its run
    dirs sort first) tried lr 0.004 and 0.016, sync tried 1e-05 and 0.002, so first-seen order (0.004, 0.016, 1e-05,
    0.002) and text order (0.002, 0.004, 0.016, 1e-05) both differ from it; each mean stays under its own value."""
    root = sweep(tmp_path / "s", "s", ["sync", "1-step"])
    finals = {("1-step", 0.004): 3.4, ("1-step", 0.016): 3.3, ("sync", 1e-05): 3.2, ("sync", 0.002): 3.1}
    for (variant, lr), final in finals.items():
        for seed in range(2):
            write(root, variant, "adamw", seed, line(final + 0.05 * seed), lr=lr)
    report = build_report(root, out_dir=tmp_path / "out", plots=False, best_of="optimizer.lr", select_seeds=["0"])
    table = report.tuning.table
    assert list(table.columns) == ["optimizer", "column", "chosen", "1e-05", "0.002", "0.004", "0.016"]
    rows = table.set_index("column").drop(columns="optimizer")
    assert rows.loc["sync"].tolist() == ["0.002", "3.2000", "3.1000", "—", "—"]
    assert rows.loc["1-step"].tolist() == ["0.016", "—", "—", "3.4000", "3.3000"]
    md = (tmp_path / "out" / "report.md").read_text()
    assert "\n| optimizer | column | chosen | 1e-05 | 0.002 | 0.004 | 0.016 |\n" in md


@pytest.mark.parametrize("args,said", [
    (["--best-of", "optimizer.nope"], "no run records that setting"),
    (["--best-of", "optimizer.lr", "--select-seeds", "0,1"], "give some, not all"),
    (["--best-of", "model.name"], "nothing to choose between"),
    (["--best-of", "seed"], "the seed is what"),
    (["--select-seeds", "0"], "give --best-of KEY with it"),
])  # fmt: skip
def test_best_of_mistakes_are_one_line(tmp_path, capsys, args, said):
    root = sweep(tmp_path / "s", "s", ["sync", "1-step"])
    for seed in range(2):
        for lr in (1e-3, 2e-3):
            write(root, "sync", "adamw", seed, line(3.0), lr=lr)
            write(root, "1-step", "adamw", seed, line(3.2), lr=lr)
    with pytest.raises(SystemExit) as exit_:
        cli_main(["report", str(root), *args, "--out", str(tmp_path / "o"), "--no-plots"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1 and said in err[0], err


def test_budget_rungs_are_timed_not_shown_as_loss_columns(tmp_path):
    """A budget family (1-step at 1x and 2x): the loss table keeps sync and the 1x rung only (at the matched token
    count a longer rung's loss says nothing of its budget); the 2x rung is in the family's time to target."""
    root = sweep(tmp_path / "s", "s", ["sync", "1-step", "1-step(x2)"])
    for seed in range(2):
        L = 3.0 + 0.01 * seed
        write(root, "sync", "adamw", seed, line(L))
        write(root, "1-step", "adamw", seed, line(L + 0.2))
        write(root, "1-step(x2)", "adamw", seed, line(L - 0.1, 10000), steps=200)
    report = build_report(root, out_dir=tmp_path / "o", plots=False)
    (group,) = report.groups
    assert list(group.table.columns) == ["sync", "1-step", "gap 1-step"]
    (lad,) = report.ladders
    assert lad.columns == ["1-step", "1-step(x2)"] and lad.reached == 2
    assert "1-step(x2)" in (tmp_path / "o" / "report.md").read_text()  # named in Time to target


def test_wallclock_at_draws_every_column_at_one_depth(tmp_path, monkeypatch):
    """`--wallclock-at 4,8`: the wall-clock figure times every column at P=4, m=8 (no bench file: the ideal 11/8)
    while the takeaway keeps the run's own P=2, m=4; P,m given wrong is one line."""
    root = sweep(tmp_path / "s", "s", ["sync", "1-step", "1-step(x2)"])
    for seed in range(2):
        write(root, "sync", "adamw", seed, line(3.0 + 0.01 * seed))
        write(root, "1-step", "adamw", seed, line(3.2))
        write(root, "1-step(x2)", "adamw", seed, line(2.9, 10000), steps=200)
    drawn = []
    monkeypatch.setattr("asyncpipe.report.wallclock.save_figure", lambda fig, path: drawn.append(fig) or [])
    report = build_report(root, out_dir=tmp_path / "o", wallclock_at=(4, 8))
    legend = [t.get_text() for ax in drawn[0].axes for t in ax.get_legend().get_texts()]
    assert any("÷1.375, ideal (m+P-1)/m at P=4, m=8" in t for t in legend), legend
    assert "P=4, m=8" in drawn[0]._suptitle.get_text() and "--wallclock-at 4,8" in report.command
    assert any("at P=2, m=4" in t for t in report.takeaways)
    plt.close("all")
    res = CliRunner().invoke(app, ["report", str(root), "--wallclock-at", "8,4", "--out", str(tmp_path / "x")])
    assert res.exit_code != 0 and "--wallclock-at 8,4: give P,m" in str(res.exception)  # one line from cli.main
    assert not (tmp_path / "x" / "report.md").exists()


def test_a_token_ratio_reaching_below_zero_leaves_the_speed_up_unbounded_not_negative():
    """Two seeds' Fieller interval of a token ratio can reach below 0 (v5's AdamW 2BW+EF at 2 seeds: 1.43x
    [-0.14, 3.0]): no run needs fewer than 0 tokens, so the net speed-up is unbounded above, not '[0.40, -8.34]',
    and the takeaway says 'not resolved', never 'later'."""
    from asyncpipe.report.stats import Interval
    from asyncpipe.report.target import Ladder, net_speedup, phrase

    iv = Interval(1.43, -0.14, 2.98, 2, "fieller")
    assert net_speedup(iv, None, 1.19) == "0.83x [0.40, ∞)"
    lad = Ladder("t", "adamw", ["1-step+EF", "1-step+EF(x2)"], [1.0, 2.0], True, 2, 4, ratio=iv,
                 per_seed={3: (1.0, True, 1.0), 4: (1.0, True, 1.0)})  # fmt: skip
    said = phrase(lad, [])
    assert "is not resolved" in said and "later" not in said
    assert net_speedup(Interval(2.0, 1.5, 2.5, 3, "fieller"), None, 1.25) == "0.62x [0.50, 0.83]"
