"""Tied embeddings in the cost model: the two copies' gradient all-reduce (first and last stage,
`engines.pipeline.tied`) makes those two stages' optimizer steps wait for each other; under global clipping every
stage already waits for all."""

from __future__ import annotations

import pytest

from asyncpipe.schedules.instructions import ForwardPass, OptimizerStep, ReduceGrads
from asyncpipe.timelines.cost import CostModel, predict
from asyncpipe.timelines.timeline import simulate


def _streams(n: int) -> list[list]:
    one = [ForwardPass(micro_batch=0), ReduceGrads(batch=0), OptimizerStep(batch=0), ForwardPass(micro_batch=1)]
    return [list(one) for _ in range(n)]


@pytest.mark.parametrize(
    "groups, ends",
    [
        # stage 0's forward takes 3, the others' 1: alone each stage runs F, step (free), F
        (False, [6.0, 2.0, 2.0]),
        # a pair (0, 2): stage 2 steps once stage 0 starts its all-reduce at 3, then its second forward: 4
        ([[0, 2]], [6.0, 2.0, 4.0]),
        # everyone: stages 1 and 2 wait for stage 0 at 3
        (True, [6.0, 4.0, 4.0]),
    ],
)
def test_a_step_waits_only_for_its_group(groups, ends) -> None:
    tl = simulate(_streams(3), forward=[3.0, 1.0, 1.0], step=0.0, collective_steps=groups)
    assert [max(e.end for e in tl.events if e.stage == s) for s in range(3)] == ends


def _model() -> CostModel:
    """Six equal blocks of F = 1, B = 2, a free embedding and head, a free step: P = 3 takes two blocks a stage."""
    return CostModel(
        "hand",
        False,
        forward=[0.0] + [1.0] * 6 + [0.0],
        backward=[0.0] + [2.0] * 6 + [0.0],
        params=[0] + [1] * 6 + [0],
        tokens_per_micro_batch=1,
        step_per_param=0.0,
    )


def test_tied_paci_pays_the_wait_and_the_global_norm_schedules_already_do() -> None:
    """PACI (per-stage clipping, no barrier) on equal stages (F = 2, B = 4 a stage): untied, a steady step is
    m x (F + B). Tied, the last stage's step waits for stage 0 to start its all-reduce, after the batch's last
    micro-batch has gone back through the P - 1 stages before it: (P - 1) x B = 8 more per batch, whatever m.
    1F1B and 2BW under a global norm wait for every stage anyway: tied or not, the same step."""
    P = 3
    for m in (3, 6, 9):
        untied = predict(_model(), "paci", P, m, clip="stage")
        tied = predict(_model(), "paci", P, m, clip="stage", tied=True)
        assert untied.step_s == pytest.approx(m * (2.0 + 4.0))
        assert tied.step_s == pytest.approx(m * (2.0 + 4.0) + (P - 1) * 4.0) and tied.bubble > untied.bubble
    m = 6
    for name in ("1f1b", "2bw"):
        assert predict(_model(), name, P, m, tied=True).step_s == predict(_model(), name, P, m).step_s


def test_the_tied_table_in_the_doc_is_its_json() -> None:
    """docs/performance.md's tied stand-in table is `benchmarks/tied_table.py` on the committed JSON, and there the
    model with the tied pair's wait is within 5% of every measured step; without it, tied PACI is not."""
    import importlib.util
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("tied_table", repo / "benchmarks" / "tied_table.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    import json

    rows = mod.table(json.loads(mod.JSON.read_text()))
    doc = (repo / "docs" / "performance.md").read_text()
    assert mod.render(rows) in doc.split("<!-- tied-table:start -->")[1].split("<!-- tied-table:end -->")[0]
    assert all(abs(r["error"]) < 0.05 for r in rows)
    paci = next(r for r in rows if r["run"] == "tied" and r["schedule"] == "paci")
    assert paci["untied_model_s"] / paci["measured_s"] - 1 < -0.05


def test_the_tied_all_reduce_costs_its_bytes_over_the_pipelines_link() -> None:
    """A 1,000-parameter tied matrix over a 4,000 bytes/s link: 4,000 bytes, 1 s more on the first and last stage's
    step; 1F1B's flushed step (a global norm: every stage waits for the slowest step) grows by exactly that, and
    without a known link bandwidth by nothing (the latency here is 0)."""
    from dataclasses import replace

    base = replace(_model(), params=[1000] + [1] * 6 + [0])
    linked = replace(base, link_bytes_per_s=4000.0)
    P, m = 3, 6
    plain = predict(base, "1f1b", P, m).step_s
    assert predict(base, "1f1b", P, m, tied=True).step_s == pytest.approx(plain)
    assert predict(linked, "1f1b", P, m, tied=True).step_s == pytest.approx(plain + 1.0)
