"""Balanced cuts within a memory budget (`pipeline.memory_gib`, `asyncpipe plan --gpu-mem`): the partition search
over only the cuts a ``fits`` predicate accepts (hand-derived and exhaustive), no budget = the cut of before, the
plan's memory model as the predicate (`plan.cut_within`), one line where no cut fits or the cut is a V, the plan
saying how the budget moved the cut, and the run (its recorded config, the simulator, the pipeline engine and its
start-up line) on it."""

from __future__ import annotations

import itertools
import re

import pytest
from typer.testing import CliRunner

from asyncpipe.config import compose
from asyncpipe.errors import ConfigError, UserError
from asyncpipe.partition import (
    NoCutFits,
    balanced_blocks,
    chunk_costs,
    cut_blocks,
    layer_weights,
    least_peak,
    partition,
)
from asyncpipe.plan import GIB, budgeted, plan

# emb, 6 blocks of 1, a head of 3; a chunk's "memory": its layers x the micro-batches it holds (3 - chunk, as 1F1B)
COSTS = [0.0] + [1.0] * 6 + [3.0]


def hand_memory(c: int, first: int, end: int) -> float:
    return (end - first) * (3 - c)


def cuts(n_blocks: int, chunks: int) -> list[list[int]]:
    return [list(c) for c in itertools.product(range(1, n_blocks + 1), repeat=chunks) if sum(c) == n_blocks]


def fits_all(blocks: list[int], memory, budget: float) -> bool:
    parts = partition(sum(blocks) + 2, len(blocks), blocks)
    return all(memory(c, parts[c], parts[c + 1]) <= budget for c in range(len(blocks)))


def test_a_budget_moves_the_cut_to_the_hand_derived_next_best() -> None:
    # Unconstrained: bottleneck 4 at [2, 3, 1] (test_cuts): chunk 0 holds emb + 2 blocks x 3 in flight = 9.
    free = balanced_blocks(COSTS, 3)
    assert free == [2, 3, 1] and max(chunk_costs(COSTS, free)) == 4.0
    # Within 6: chunk 0 at most 2 layers (emb + 1 block), chunk 1 at most 3 blocks, so [1, 3, 2]: costs 1, 3, 2 + 3
    # = 5, the only cut of bottleneck 5 that fits ([1, 2, 3] costs 6).
    fits = lambda c, i, j: hand_memory(c, i, j) <= 6  # noqa: E731
    assert balanced_blocks(COSTS, 3, fits) == [1, 3, 2]
    # Within 8 the bottleneck stays 4, at [1, 4, 1] (chunk 0 still one block; 1 + 4 blocks' memory 8 on chunk 1)
    assert balanced_blocks(COSTS, 3, lambda c, i, j: hand_memory(c, i, j) <= 8) == [1, 4, 1]


@pytest.mark.parametrize("budget", [5, 6, 7, 8, 9, 12])
def test_the_budgeted_cut_is_the_least_bottleneck_among_those_that_fit(budget: float) -> None:
    costs = [0.5, 1.0, 2.0, 1.0, 1.0, 3.0, 1.0, 0.5, 4.0]  # emb, 7 uneven blocks, a heavy head
    for chunks in (2, 3, 4):
        memory = lambda c, i, j: (j - i) * (chunks - c)  # noqa: E731
        fitting = [c for c in cuts(7, chunks) if fits_all(c, memory, budget)]
        fits = lambda c, i, j: memory(c, i, j) <= budget  # noqa: E731
        if not fitting:
            with pytest.raises(NoCutFits):
                balanced_blocks(costs, chunks, fits)
            continue
        cut = balanced_blocks(costs, chunks, fits)
        assert cut in fitting
        assert max(chunk_costs(costs, cut)) == pytest.approx(min(max(chunk_costs(costs, c)) for c in fitting))


def test_the_least_peak_is_the_smallest_costliest_chunk_over_every_cut() -> None:
    for chunks in (1, 2, 3, 4):
        memory = lambda c, i, j: (j - i) * (chunks - c) + 0.5 * (c == chunks - 1)  # noqa: E731
        peak, at = least_peak(8, chunks, memory)
        best = min(max(memory(c, *partition(8, chunks, b)[c : c + 2]) for c in range(chunks)) for b in cuts(6, chunks))
        assert peak == best
        parts = partition(8, chunks, at)
        assert max(memory(c, parts[c], parts[c + 1]) for c in range(chunks)) == best


def test_no_budget_is_the_cut_of_before() -> None:
    for costs in (COSTS, [0.0] + [1.0] * 5 + [0.01], [0.5, 1.0, 2.0, 1.0, 1.0, 3.0, 1.0, 0.5, 4.0]):
        for chunks in range(1, len(costs) - 1):
            assert balanced_blocks(costs, chunks, lambda *_: True) == balanced_blocks(costs, chunks)


REAL = ["model=360m", "pipeline.stages=8", "train.micro_batch_size=4", "train.seq_len=2048", "train.micro_batches=16"]


@pytest.mark.parametrize("schedule", [["delay=0"], ["delay=1"], ["pipeline.schedule=dualpipev", "delay=0"]])
def test_without_a_budget_plan_and_run_cut_as_before(schedule: list[str]) -> None:
    cfg = compose([*REAL, *schedule])
    pl = plan(cfg, 80)
    assert pl.cut == cut_blocks(cfg) and pl.cut_note == "" and budgeted(cfg) is cfg
    # a budget the unconstrained cut fits keeps it exactly
    roomy = compose([*REAL, *schedule, "pipeline.memory_gib=80"])
    assert budgeted(roomy).pipeline.cut == cut_blocks(cfg) and plan(roomy, 80).cut_note == ""


def _peak(cfg) -> float:
    return max(s.total for s in plan(cfg, 80).stages) / GIB


def test_360m_at_8_stages_within_a_budget_that_binds() -> None:
    """2BW at the paper's size: half a GiB under the unconstrained cut's peak, the cut moves; every stage fits, and
    no cut one block away that fits has a cheaper slowest stage."""
    two_bw = [*REAL, "delay=1"]
    free_peak = _peak(compose(two_bw))
    budget = round(free_peak - 0.5, 2)
    cfg = compose([*two_bw, f"pipeline.memory_gib={budget}"])
    cut = list(budgeted(cfg).pipeline.cut)
    free = cut_blocks(compose(two_bw))
    assert cut != free and sum(cut) == 32
    pl = plan(cfg, budget)
    assert pl.cut == cut and all(s.total <= budget * GIB for s in pl.stages)
    weights = layer_weights(cfg)
    assert max(chunk_costs(weights, cut)) >= max(chunk_costs(weights, free))
    for a, b in itertools.permutations(range(8), 2):
        if abs(a - b) != 1 or cut[a] == 1:
            continue
        moved = list(cut)
        moved[a], moved[b] = moved[a] - 1, moved[b] + 1
        ok = all(s.total <= budget * GIB for s in plan(compose([*two_bw, f"pipeline.cut={moved}"]), budget).stages)
        if ok:
            assert max(chunk_costs(weights, moved)) >= max(chunk_costs(weights, cut)) * (1 - 1e-9)


def test_no_cut_that_fits_is_one_line_naming_the_budget_and_the_least_peak() -> None:
    cfg = compose([*REAL, "delay=1", "pipeline.memory_gib=4"])
    with pytest.raises(ConfigError) as err:
        budgeted(cfg)
    said = str(err.value)
    assert "\n" not in said and said.startswith("pipeline.memory_gib=4: no cut into 8 stages fits")
    least = float(re.search(r"the least peak is ([\d.]+) GiB", said).group(1))
    assert 4 < least < _peak(compose([*REAL, "delay=1"]))
    assert "raise the budget, lower train.micro_batch_size, or add stages" in said
    # the plan shows the table at the unconstrained cut, with the same reason in a note
    pl = plan(cfg, 4)
    assert pl.cut == cut_blocks(compose([*REAL, "delay=1"])) and said in pl.cut_note and not pl.fits


def test_a_v_is_refused_a_budget_that_binds_in_one_line() -> None:
    cfg = compose([*REAL, "pipeline.schedule=dualpipev", "delay=0", "pipeline.memory_gib=12"])
    with pytest.raises(ConfigError) as err:
        budgeted(cfg)
    said = str(err.value)
    assert "the V cut (dualpipev: rank r holds chunks r and 15-r) needs" in said and "\n" not in said
    assert "is not re-cut within a budget" in said and said in plan(cfg, 12).cut_note


def test_bad_budgets_are_one_line() -> None:
    with pytest.raises(ConfigError, match=r"pipeline.memory_gib=0.0 must be > 0"):
        compose(["pipeline.memory_gib=0"])
    with pytest.raises(UserError, match="two budgets for one plan"):
        plan(compose([*REAL, "pipeline.memory_gib=40"]), 80)
    with pytest.raises(ConfigError, match="give the cut as a list"):  # a reader without the plan's predicate
        cut_blocks(compose([*REAL, "pipeline.memory_gib=40"]))


def test_plan_says_how_the_budget_moved_the_cut() -> None:
    from asyncpipe.cli import app

    two_bw = [*REAL, "delay=1", "pipeline.schedule=2bw"]
    budget = round(_peak(compose(two_bw)) - 0.5, 2)
    cut = budgeted(compose([*two_bw, f"pipeline.memory_gib={budget}"])).pipeline.cut
    free = cut_blocks(compose(two_bw))
    csv = lambda b: ",".join(map(str, b))  # noqa: E731
    said = f"cut {csv(cut)} (balanced within pipeline.memory_gib={budget:g}; unconstrained {csv(free)} needs "
    for how in (["--gpu-mem", str(budget)], [f"pipeline.memory_gib={budget}"]):
        out = CliRunner().invoke(app, ["plan", *two_bw, *how])
        assert f"note: {said}" in out.output, out.output
        assert re.search(rf"^  2bw: {re.escape(said)}", out.output, re.M)
        row = next(line for line in out.output.splitlines() if line.startswith("  2bw "))
        assert row.endswith(csv(cut)) and " yes " in row
        assert f"budget {budget:g} GiB per device" in out.output and out.exit_code == 0
    out = CliRunner().invoke(app, ["plan", *two_bw, "pipeline.memory_gib=40", "--gpu-mem", "30"])
    assert isinstance(out.exception, UserError) and "two budgets for one plan" in str(out.exception)


TINY_PACI = [
    "model=tiny",
    "model.n_layer=8",
    "pipeline.stages=2",
    "pipeline.schedule=paci",
    "precision=fp32",
    "device=cpu",
    "train.steps=2",
    "tracker.wandb.mode=disabled",
]


def test_the_recorded_config_and_the_simulator_take_the_budgeted_cut(tmp_path) -> None:
    """`asyncpipe train`'s config (what config.yaml records) carries the chosen cut as a list; the simulator's
    per-stage staleness (PACI runs stage by stage) and its clip groups read it through `cut_blocks`."""
    import torch

    from omegaconf import OmegaConf

    from asyncpipe.config import to_yaml
    from asyncpipe.run import compose_run
    from asyncpipe.session.rundir import changed_settings
    from asyncpipe.trainer import Trainer

    free = plan(compose(TINY_PACI), 80)
    budget = round(max(s.total for s in free.stages) / GIB * 0.9, 4)  # stage 0 (two micro-batches held) over it
    over = [*TINY_PACI, f"pipeline.memory_gib={budget}", f"run.dir={tmp_path / 'run'}"]
    cfg = compose_run(over)
    cut = list(cfg.pipeline.cut)
    assert cut != free.cut and cut[0] < free.cut[0]
    assert f"cut:\n  - {cut[0]}\n  - {cut[1]}\n  memory_gib: {budget}" in to_yaml(cfg)
    recorded = OmegaConf.to_container(cfg, resolve=True)  # a resume composes the same overrides again
    assert changed_settings(recorded, compose_run(over)) == []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = Trainer(compose(over)).engine  # from the overrides as a sweep's rank gets them: balanced
    finally:
        torch.set_num_threads(threads)
    assert [len(stage) for stage in engine.staged.stages] == [cut[0] + 1, cut[1] + 1]


def test_the_pipeline_engines_start_up_line_says_the_cut_and_where_it_came_from() -> None:
    """`PipelineEngineAdapter.describe`'s cut: a rule as given; a budget's cut (the config keeps only its list,
    `budgeted`) as the balanced cut within the budget; any other list as itself, budget or not."""
    from asyncpipe.engines.pipeline.adapter import cut_said

    csv = lambda b: ",".join(map(str, b))  # noqa: E731
    cfg = compose(TINY_PACI)
    free = cut_blocks(cfg)
    assert cut_said(cfg, free) == f"cut {csv(free)} (pipeline.cut=balanced)"
    even = compose([*TINY_PACI, "pipeline.cut=even"])
    assert cut_said(even, cut_blocks(even)) == f"cut {csv(cut_blocks(even))} (pipeline.cut=even)"
    budget = round(max(s.total for s in plan(cfg, 80).stages) / GIB * 0.9, 4)
    run = budgeted(compose([*TINY_PACI, f"pipeline.memory_gib={budget}"]))
    cut = list(run.pipeline.cut)
    assert cut != free
    assert cut_said(run, cut) == f"pipeline.cut={csv(cut)} (balanced within pipeline.memory_gib={budget:g})"
    given = compose([*TINY_PACI, f"pipeline.memory_gib={budget}", f"pipeline.cut={free}"])  # over the budget
    assert cut_said(given, free) == f"pipeline.cut={csv(free)}"
    assert cut_said(compose([*TINY_PACI, f"pipeline.cut={cut}"]), cut) == f"pipeline.cut={csv(cut)}"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_pipeline_engine_runs_and_records_the_budgeted_cut() -> None:
    from asyncpipe.spawn import Job, launch

    base = [
        "model=tiny",
        "model.n_layer=6",
        "engine=pipeline",
        "pipeline.stages=2",
        "delay=0",
        "precision=fp32",
        "device=cpu",
        "train.steps=2",
        "train.micro_batches=4",
        "train.eval_every=2",
        "train.eval_batches=2",
        "pipeline.threads=1",
        "run.dir=unused",
        "tracker.wandb.mode=disabled",
    ]
    free = plan(compose(base), 80)
    budget = round(max(s.total for s in free.stages) / GIB * 0.9, 4)
    cfg = compose([*base, f"pipeline.memory_gib={budget}"])
    cut = list(budgeted(cfg).pipeline.cut)
    assert cut != free.cut
    result = launch([Job(cfg, None, show_progress=False)], timeout_s=240)[0]
    assert [st["blocks_per_stage"] for st in result["stages"]] == [cut, cut]


def test_the_docs_budget_figures_are_what_plan_predicts() -> None:
    """docs/performance.md's 360m example under --gpu-mem 12 and 14: the cuts, peak and tokens/s plan prints."""
    from pathlib import Path

    from asyncpipe.plan_speed import speeds

    doc = re.sub(r"\s+", " ", (Path(__file__).resolve().parents[1] / "docs" / "performance.md").read_text())
    free = {r.schedule: r for r in speeds(REAL, 80.0)[0]}["2bw"]
    at = {g: {r.schedule: r for r in speeds([*REAL, f"pipeline.memory_gib={g}"], g)[0]}["2bw"] for g in (12.0, 14.0)}
    csv = lambda b: ",".join(map(str, b))  # noqa: E731
    said = (
        f"2BW's cut is {csv(at[12.0].cut)} (unconstrained {csv(free.cut)} needs {free.peak_gib:.1f} GiB on stage 0), "
        f"peak {at[12.0].peak_gib:.1f} GiB, {at[12.0].tokens_per_s:,.0f} tokens/s predicted against "
        f"{free.tokens_per_s:,.0f}; at `--gpu-mem 14` it is {csv(at[14.0].cut)} at no predicted cost"
    )
    assert said in doc
    assert at[14.0].tokens_per_s == pytest.approx(free.tokens_per_s, rel=1e-3) and at[14.0].cut != free.cut


def test_bench_pipeline_runs_each_schedule_at_its_budgeted_cut() -> None:
    """`bench pipeline` under `pipeline.memory_gib` resolves each variant's balanced cut within the budget, as a run
    does (tiny, 6 blocks, P = 2: unconstrained 3,3; within 0.012 GiB 1F1B runs 2,4), and a schedule no cut of which
    fits (2BW's second weight version) is skipped with the reason instead of failing the bench."""
    from asyncpipe.bench.pipeline import plan_bench
    from asyncpipe.config import compose
    from asyncpipe.partition import cut_blocks

    over = ["model=tiny", "model.n_layer=6", "pipeline.stages=2", "train.micro_batches=4"]
    assert cut_blocks(compose([*over, "engine=pipeline"])) == [3, 3]
    bench, warm = plan_bench(
        [*over, "pipeline.memory_gib=0.012"], 1, 3, 1, compose, ["1f1b", "2bw"], ["eager"], None, ("balanced",)
    )
    assert list(bench.cfgs) == ["1f1b+balanced"] and list(bench.cfgs["1f1b+balanced"].pipeline.cut) == [2, 4]
    assert "no cut into 2 stages fits" in bench.skipped["2bw+balanced"]
    assert warm.pipeline.memory_gib is None  # the untimed warm-up runs whatever cut
