"""`asyncpipe schedule`: timelines drawn from the engine's own schedule streams (and from recorded traces)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from asyncpipe import cli_perf
from asyncpipe.errors import UserError
from asyncpipe.timelines import draw
from asyncpipe.timelines.orders import ideal_timeline, sync_timeline
from asyncpipe.timelines.timeline import steady_gaps
from asyncpipe.timelines.trace_load import trace_timeline


def _app() -> typer.Typer:
    app = typer.Typer(pretty_exceptions_enable=False)
    app.command("schedule")(cli_perf.schedule)
    app.command("other")(lambda: None)  # two commands: typer keeps "schedule" as a subcommand name
    return app


def _rows(text: str) -> dict[str, str]:
    """Each stage's whole row: the wrapped windows of a text timeline joined, frame marks dropped."""
    rows: dict[str, str] = {}
    for line in text.splitlines():
        if re.match(r"S\d+ +\|", line):
            name, cells = line.split("|", 1)
            rows[name.strip()] = rows.get(name.strip(), "") + cells.rstrip("|")
    return rows


@pytest.mark.parametrize("kind", ["2bw", "1f1b", "gpipe"])
def test_schedule_command_writes_png_and_text(tmp_path: Path, kind: str) -> None:
    res = CliRunner().invoke(_app(), ["schedule", "--stages", "4", "--micro-batches", "8", "--schedule", kind,
                                      "--batches", "3", "--out", str(tmp_path)])  # fmt: skip
    assert res.exit_code == 0, res.output
    png, txt = tmp_path / f"{kind}-P4-m8.png", tmp_path / f"{kind}-P4-m8.txt"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    rows = _rows(txt.read_text())
    assert list(rows) == ["S0", "S1", "S2", "S3"]
    assert rows["S0"].startswith("F0  F1  ")  # stage 0 starts at once with its first forwards
    assert rows["S3"].startswith("." * 12 + "F0 ")  # the last stage waits three forward slots
    # Every forward and backward of every micro-batch is drawn exactly once per stage.
    for row in rows.values():
        assert sorted(int(k) for k in re.findall(r"F(\d+)", row)) == list(range(24))
        assert sorted(int(k) for k in re.findall(r"B(\d+)", row)) == list(range(24))


def test_2bw_never_idles_between_batches_after_warmup_but_1f1b_does() -> None:
    tl = ideal_timeline("2bw", 4, 8, 3)
    assert steady_gaps(tl) == [0.0] * 4
    # The batch boundaries lie inside that steady window on every stage: the steps of batches 0 and 1.
    for s in range(4):
        fwd = [e for e in tl.events if e.stage == s and e.kind == "forward"]
        bwd = [e for e in tl.events if e.stage == s and e.kind == "backward"]
        steps = [e for e in tl.events if e.stage == s and e.kind == "step"]
        assert len(steps) == 3
        assert all(min(b.start for b in bwd) < u.start < max(f.end for f in fwd) for u in steps[:2])
    flushed = ideal_timeline("1f1b", 4, 8, 3)
    assert all(g > 0 for g in steady_gaps(flushed))


@pytest.mark.parametrize("stages,m", [(2, 2), (2, 4), (2, 8), (4, 8), (3, 5)])
@pytest.mark.parametrize("fwd,bwd", [(1.0, 1.0), (1.0, 2.0)])
def test_flushed_schedules_idle_exactly_the_bubble_formula(stages: int, m: int, fwd: float, bwd: float) -> None:
    bubble = (stages - 1) / (m + stages - 1)
    for kind in ("1f1b", "gpipe"):
        tl = ideal_timeline(kind, stages, m, 3, forward=fwd, backward=bwd, step=0.0)
        assert tl.idle_fraction == pytest.approx([bubble] * stages)
    # 2BW pays the fill and drain once per run, not once per batch.
    tl = ideal_timeline("2bw", stages, m, 3, forward=fwd, backward=bwd, step=0.0)
    assert tl.idle_fraction == pytest.approx([(stages - 1) / (3 * m + stages - 1)] * stages)


def test_unknown_schedule_is_a_user_error() -> None:
    with pytest.raises(UserError, match="choose one of"):
        ideal_timeline("interleaved", 2, 4, 1)


def _op(name: str, start: float, mb=None, stage: int = 0) -> dict:
    return {"stage": stage, "replica": 0, "op": name, "micro_batch": mb, "start": start, "end": start + 0.5}


def test_trace_of_a_1f1b_run_is_numbered_and_evaluation_is_set_apart(tmp_path: Path) -> None:
    # One stage, m=2, 2 steps, eval_every=1 with 1 eval forward: E, F F B B U, E, F F B B U, E.
    seq = ["ForwardPass", "LoadMicroBatch", "ForwardPass", "ForwardPass", "BackwardPass", "BackwardPass",
           "OptimizerStep", "ForwardPass", "ForwardPass", "ForwardPass", "BackwardPass", "BackwardPass",
           "OptimizerStep", "ForwardPass"]  # fmt: skip
    (tmp_path / "trace-rank0.json").write_text(json.dumps([_op(n, 10.0 + i) for i, n in enumerate(seq)]))
    cfg = "train:\n  steps: 2\n  eval_every: 1\n  eval_batches: 1\n  micro_batches: 2\n"
    (tmp_path / "config.yaml").write_text(cfg)
    tl = trace_timeline(tmp_path)
    got = [(e.kind, e.micro_batch) for e in tl.events]
    assert got == [("eval", None), ("forward", 0), ("forward", 1), ("backward", 0), ("backward", 1), ("step", None),
                   ("eval", None), ("forward", 2), ("forward", 3), ("backward", 2), ("backward", 3), ("step", None),
                   ("eval", None)]  # fmt: skip
    assert tl.events[0].start == 0.0 and tl.makespan == pytest.approx(13.5)
    assert tl.busy == [pytest.approx(13 * 0.5)]


def test_trace_of_a_2bw_run_keeps_its_micro_batches(tmp_path: Path) -> None:
    ops = [_op("ForwardPass", 0.0), _op("ForwardPass", 1.0, 0), _op("CommitP2P", 1.5), _op("BackwardPass", 2.0, 0)]
    (tmp_path / "trace-rank0.json").write_text(json.dumps(ops))
    (tmp_path / "trace-rank1.json").write_text(json.dumps([_op("ForwardPass", 1.2, 0, stage=1)]))
    tl = trace_timeline(tmp_path)
    assert [(e.stage, e.kind, e.micro_batch) for e in tl.events] == [
        (0, "eval", None), (0, "forward", 0), (0, "backward", 0), (1, "forward", 0)]  # fmt: skip
    assert tl.idle_fraction[0] == pytest.approx(1 - 1.5 / 2.5)  # the commit's wait counts as idle
    text = draw.render_text(tl, cell=0.5, width=1)
    assert text.splitlines()[:2] == ["t  |0", "S0 |E.F.B|"]  # 0.5 s blocks with 0.5 s gaps


def test_trace_missing_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="pipeline.trace=true"):
        trace_timeline(tmp_path)


@pytest.mark.slow
def test_a_traced_pipeline_run_draws_its_measured_timeline(tmp_path: Path) -> None:
    from asyncpipe.config import compose
    from asyncpipe.run import run_training

    run = tmp_path / "run"
    cfg = compose(["model=tiny", "engine=pipeline", "delay=1", "pipeline.stages=2", "train.micro_batches=2",
                   "train.micro_batch_size=2", "train.seq_len=16", "train.steps=3", "train.eval_batches=1",
                   "pipeline.trace=true", f"run.dir={run}", "tracker.wandb.mode=disabled"])  # fmt: skip
    assert run_training(cfg, log=lambda _: None)["status"] == "completed"
    res = CliRunner().invoke(_app(), ["schedule", "--trace", str(run), "--out", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "out" / "trace-run.png").exists() and (tmp_path / "out" / "trace-run.txt").exists()
    tl = trace_timeline(run)
    for s in (0, 1):
        assert sorted(e.micro_batch for e in tl.events if e.stage == s and e.kind == "forward") == list(range(6))
        assert sum(e.kind == "step" for e in tl.events if e.stage == s) == 3


def test_text_timelines_wrap_to_a_readable_width_and_explain_themselves(tmp_path: Path) -> None:
    # (schedule, P, m, micro-batches drawn, forwards of each per stage: dualpipev's two chunks)
    cases = [("2bw", 4, 16, 4 * 16, 1), ("dualpipev", 8, 16, 16, 2), ("1f1b", 12, 12, 3 * 12, 1)]
    for kind, p, m, n_forwards, chunks in cases:
        res = CliRunner().invoke(_app(), ["schedule", "-p", str(p), "-m", str(m), "--schedule", kind,
                                          "--batches", "4" if kind == "2bw" else "3", "--out", str(tmp_path)])  # fmt: skip
        assert res.exit_code == 0, res.output
        text = (tmp_path / f"{kind}-P{p}-m{m}.txt").read_text()
        assert max(len(line) for line in text.splitlines()) <= draw.LINE_WIDTH
        legend = text.split("#", 1)[0].replace("\n", " ")
        assert legend.startswith("legend: ") and "F3 forward of micro-batch 3" in legend and "'.' idle" in legend
        # The wrapped windows hold every cell (each stage's joined row as long as the others) and every forward of
        # the first panel; row names line up past 10 stages.
        assert len({len(r) for r in _rows(text).values()}) == 1
        for row in _rows(text.split("#", 2)[1]).values():
            assert sorted(int(k) for k in re.findall(r"F(\d+)", row)) == sorted(list(range(n_forwards)) * chunks)
    assert "a / b after the number" in (tmp_path / "dualpipev-P8-m16.txt").read_text().replace("\n", " ")
    assert "W(b-1)" in (tmp_path / "2bw-P4-m16.txt").read_text()  # the 2BW rule, read off the events
    assert "S11 |" in (tmp_path / "1f1b-P12-m12.txt").read_text() and "S0  |" in (tmp_path / "1f1b-P12-m12.txt").read_text()


def test_2bw_batches_and_weight_versions_are_read_off_the_engine_streams() -> None:
    tl = ideal_timeline("2bw", 4, 8, 3)
    assert draw.batch_size(tl) == 8
    starts = draw.batch_starts(tl)
    assert [(s, b) for s, b, _ in starts] == [(s, b) for s in range(4) for b in (1, 2)]
    # Batch b+1 enters stage 0 before batch b's last backward there (no flush), and under 1F1B only after it.
    for kind, before in (("2bw", True), ("1f1b", False)):
        tl = ideal_timeline(kind, 4, 8, 2)
        enter = draw.batch_starts(tl)[0][2]
        last_b0 = max(e.end for e in tl.events if e.stage == 0 and e.kind == "backward" and e.micro_batch < 8)
        assert (enter < last_b0) is before
    assert "W(b-1)" in draw.version_rule(ideal_timeline("2bw", 4, 8, 3))
    assert "W(b)" in draw.version_rule(ideal_timeline("1f1b", 4, 8, 3))
    assert draw.version_rule(sync_timeline("dualpipev", 4, 8)) is None  # one batch, no versions


@pytest.mark.parametrize("kind,stages,m", [("2bw", 4, 8), ("dualpipev", 4, 8), ("dualpipev", 8, 16)])
def test_schedule_pictures_number_every_block_and_keep_the_legend_inside(kind: str, stages: int, m: int) -> None:
    from matplotlib.text import Text

    if kind == "2bw":
        panels = [("2bw", ideal_timeline("2bw", stages, m, 3))]
    else:
        panels = [(kind, sync_timeline(kind, stages, m)), ("1f1b", sync_timeline("1f1b", stages, m)),
                  ("2bw", ideal_timeline("2bw", stages, m, 3, step=0.0))]  # fmt: skip
    fig = draw.figure(panels)
    fig.canvas.draw()
    for ax, (_, tl) in zip(fig.axes, panels):
        shown = sorted(t.get_text() for t in ax.texts if isinstance(t, Text) and t.get_text()[:1].isdigit())
        local = draw.local_chunks(tl)
        want = sorted(draw.label(e, local)[1:] for e in tl.events if e.kind in ("forward", "backward") and e.end > e.start)
        assert shown == want  # every forward and backward carries its micro-batch (and chunk) label
    fig_box = fig.bbox
    legend = fig.legends[0].get_window_extent()
    assert legend.y0 >= fig_box.y0 and legend.y1 <= fig_box.y1 and legend.x0 >= fig_box.x0 and legend.x1 <= fig_box.x1
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    if kind == "dualpipev":
        assert any("2nd model chunk" in x for x in labels)  # the lighter shade is explained
    assert any("W0" in x for x in labels) and any("next batch" in x for x in labels)  # versions, batch boundaries
    # No large blank band: the panels fill the height the legend leaves.
    axes_height = sum(ax.get_position().height for ax in fig.axes)
    assert axes_height > 0.6, axes_height
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_a_trace_config_lacking_a_key_labels_with_the_schema_default() -> None:
    import dataclasses

    from asyncpipe.config.schema import PipelineConfig, TrainConfig
    from asyncpipe.timelines.trace_load import eval_forwards

    t = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    d = {f.name: f.default for f in dataclasses.fields(PipelineConfig)}["data_parallel"]
    assert eval_forwards({}) == (t["eval_batches"] // d, t["eval_every"], t["steps"], t["micro_batches"])
    assert eval_forwards({"train": {"eval_batches": 6}, "pipeline": {"data_parallel": 3}})[0] == 2  # per replica
    assert eval_forwards({"train": {"eval_batches": 7, "steps": 9}, "pipeline": {"data_parallel": 3}})[:3:2] == (7, 9)
