"""`asyncpipe schedule OVERRIDES`: the cost model's timeline of a run, its stages at their own costs under the cut the
run would take (plan, the cost model and the drawing read the same cut)."""

from __future__ import annotations

from typer.testing import CliRunner

RUN = ["model=360m", "pipeline.stages=4", "train.micro_batch_size=4", "train.seq_len=2048", "train.micro_batches=8"]


def test_the_drawing_is_the_cost_models_timeline_at_the_runs_cut(tmp_path) -> None:
    """The title names plan's cut and the predicted step; the drawn stages' busy time is the cost model's: the head's
    stage (5 blocks + head at 360m's 49,152 tokens) as busy as the others within the replay's own figures."""
    from asyncpipe.cli import app
    from asyncpipe.config import compose
    from asyncpipe.plan import plan
    from asyncpipe.plan_speed import modelled, run_model
    from asyncpipe.timelines.cost import predict

    over = [*RUN, "pipeline.schedule=2bw", "delay=1"]
    res = CliRunner().invoke(app, ["schedule", *over, "--batches", "3", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    cfg = compose([*over, "engine=pipeline"])
    cut = plan(cfg).cut
    model, how = run_model(cfg, "h100_assumed", cut)
    step = predict(model, "2bw", 4, 8, **how, cut=cut).step_s
    title = f"2bw: model 360m, P=4, m=8, cut {','.join(map(str, cut))}, 3 batches; step {step * 1e3:.1f} ms"
    assert title in res.output and cut != [8, 8, 8, 8]
    assert (tmp_path / "modelled-2bw.png").stat().st_size > 0 and title in (tmp_path / "modelled-2bw.txt").read_text()
    _, tl = modelled(over, batches=3)
    assert len([e for e in tl.events if e.kind == "step"]) == 3 * 4 and tl.makespan > 2 * step
