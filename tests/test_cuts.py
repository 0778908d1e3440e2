"""Stage cuts (`pipeline.cut`, `asyncpipe.partition`): the balanced cut against hand-computed optima, the even cut
kept where it is as fast, a list checked in one line, and every reader (plan, cost model, simulator, engine) on
the same cut."""

from __future__ import annotations

import itertools

import pytest

from asyncpipe.config import compose
from asyncpipe.errors import ConfigError
from asyncpipe.partition import balanced_blocks, chunk_costs, cut_blocks, even_blocks, partition, stage_layers
from asyncpipe.shapes import layer_flops


def test_balanced_cut_of_a_small_cost_vector_is_the_hand_computed_optimum() -> None:
    # [emb, 6 blocks of 1, head of 3] over 3 stages. Even: [2, 2, 2] -> the last stage costs 2 + 3 = 5.
    # Best: the head's stage takes 1 block (1 + 3 = 4), the others 3 and 2 (or 2 and 3): bottleneck 4; of the two,
    # least sum of squares ties (9 + 4 + 16 = 4 + 9 + 16), so the earliest boundaries: [2, 3, 1]... by the DP's
    # tie rule the first stage is the lighter one.
    costs = [0.0] + [1.0] * 6 + [3.0]
    assert max(chunk_costs(costs, even_blocks(6, 3))) == 5.0
    cut = balanced_blocks(costs, 3)
    assert sorted(cut[:2]) == [2, 3] and cut[2] == 1
    assert max(chunk_costs(costs, cut)) == 4.0
    assert partition(len(costs), 3, cut) == [0, 1 + cut[0], 1 + cut[0] + cut[1], 8]


def test_balanced_cut_minimises_the_slowest_chunk_exhaustively() -> None:
    costs = [0.5, 1.0, 2.0, 1.0, 1.0, 3.0, 1.0, 0.5, 4.0]  # emb, 7 uneven blocks, a heavy head
    for chunks in range(1, 6):
        best = min(max(chunk_costs(costs, list(c))) for c in itertools.product(range(1, 8), repeat=chunks)
                   if sum(c) == 7)  # fmt: skip
        cut = balanced_blocks(costs, chunks)
        assert sum(cut) == 7 and min(cut) >= 1
        assert max(chunk_costs(costs, cut)) == pytest.approx(best)


def test_balanced_keeps_the_even_cut_where_it_is_as_fast() -> None:
    costs = [0.0] + [1.0] * 5 + [0.01]  # a cheap head (byte tokens): even [3, 2] puts the head with 2 blocks
    assert balanced_blocks(costs, 2) == even_blocks(5, 2) == [3, 2]
    assert balanced_blocks([0.0] + [1.0] * 8 + [0.0], 4) == [2, 2, 2, 2]


@pytest.mark.parametrize("model", ["tiny", "small", "mini", "moe_tiny"])
def test_the_shipped_cpu_models_cut_evenly_when_balanced(model: str) -> None:
    """With byte tokens the head is cheap: balanced is the even cut, so the golden runs and bench tables hold."""
    cfg = compose([f"model={model}"])
    for P in range(1, min(cfg.model.n_layer, 4) + 1):
        assert cut_blocks(cfg, P) == even_blocks(cfg.model.n_layer, P), (model, P)


def test_360m_at_8_stages_gives_the_head_its_own_share() -> None:
    ov = ["model=360m", "pipeline.stages=8", "train.micro_batch_size=4", "train.seq_len=2048"]
    cfg = compose(ov)
    flops = layer_flops(cfg.model, int(cfg.model.vocab_size or cfg.tokenizer.vocab_size), 2048)
    cut = cut_blocks(cfg, 8)
    assert cut == balanced_blocks(flops, 8) and cut[-1] < min(cut[:-1])
    assert max(chunk_costs(flops, cut)) < 0.7 * max(chunk_costs(flops, even_blocks(32, 8)))
    assert cut_blocks(compose([*ov, "pipeline.cut=even"]), 8) == [4] * 8
    assert cut_blocks(compose([*ov, "pipeline.cut=[5,5,5,4,4,4,4,1]"]), 8) == [5, 5, 5, 4, 4, 4, 4, 1]
    # A V (DualPipeV): 2P chunks, rank 0 holds the embedding's chunk and the head's
    parts, mine = stage_layers(34, 8, 0, v_shape=True, blocks=cut_blocks(cfg, 16))
    assert 0 in mine and 33 in mine and len(parts) == 17


@pytest.mark.parametrize(
    "value, says",
    [
        ("[1,1,2]", "must list 2 whole numbers >= 1"),
        ("[2,2,0]", "must list 3 whole numbers"),
        ("[1,1]", "holds 2 blocks; the model has 4"),
        ("[1.5,2.5]", "whole numbers"),
        ("fast", "pipeline.cut=fast is not allowed; choose one of: even, balanced"),
    ],
)
def test_a_bad_cut_is_one_line(value: str, says: str) -> None:
    stages = 3 if value == "[2,2,0]" else 2
    with pytest.raises(ConfigError) as err:
        compose(["model=tiny", "engine=pipeline", f"pipeline.stages={stages}", f"pipeline.cut={value}"])
    assert says in str(err.value) and "\n" not in str(err.value)


def test_plan_cost_model_and_simulator_read_the_same_cut() -> None:
    from asyncpipe.plan import plan

    cfg = compose(["model=tiny", "engine=pipeline", "pipeline.cut=[1,3]"])
    stages = plan(cfg).stages
    assert [s.layers for s in stages] == [(0, 2), (2, 6)]
    torch = pytest.importorskip("torch")
    from asyncpipe.engines.staged import stage_cut
    from asyncpipe.model import GPT

    torch.manual_seed(0)
    model = GPT(cfg.model, 256)
    assert stage_cut(model, 2, cut_blocks(cfg)) == [0, 2, 6]


def test_pytorch_schedules_cut_where_pipeline_cut_says() -> None:
    from asyncpipe.torch_schedules import chunk_layers, spec

    cfg = compose(["model=tiny", "engine=pipeline", "pipeline.cut=[1,3]"])
    assert chunk_layers(spec("1f1b"), 6, 2, cut_blocks(cfg, 2)) == [[0, 1], [2, 3, 4, 5]]
    assert chunk_layers(spec("1f1b"), 6, 2) == [[0, 1, 2], [3, 4, 5]]  # no cut given: even


def test_a_run_recorded_before_pipeline_cut_existed_ran_the_even_cut():
    """A config.yaml without `pipeline.cut` comes from a run that split blocks evenly: resuming it under today's
    default (balanced) is a changed setting, refused in one line; naming pipeline.cut=even resumes it."""
    from omegaconf import OmegaConf

    from asyncpipe.config import compose
    from asyncpipe.config.describe import schema_defaults
    from asyncpipe.session.rundir import changed_settings

    assert schema_defaults()["pipeline.cut"] == "even"
    old = OmegaConf.to_container(compose(["run.dir=runs/x"]), resolve=True)
    del old["pipeline"]["cut"]
    balanced = compose(["run.dir=runs/x"])
    assert balanced.pipeline.cut == "balanced"
    assert changed_settings(old, balanced) == [("pipeline.cut", "even", "balanced")]
    assert changed_settings(old, compose(["run.dir=runs/x", "pipeline.cut=even"])) == []


STANDIN_360M = [
    "model=tiny",
    "model.n_layer=32",
    "engine=pipeline",
    "pipeline.standin.profile=360m_h100",
    "pipeline.standin.scale=4",
]


def test_a_standin_profile_prices_each_layer_as_the_cost_model_prices_its_model() -> None:
    """Per-layer stand-in seconds (`asyncpipe.standin_costs`) are the cost model's per-layer figures of the profile's
    model and micro-batch under its device profile, times the scale; the head at 360m's vocabulary weighs ~4 blocks."""
    from asyncpipe.standin_costs import layer_costs
    from asyncpipe.timelines.cost_source import from_profile, load_profile

    fwd, bwd = layer_costs(compose([*STANDIN_360M, "pipeline.stages=8"]))
    at_360m = compose(["model=360m", "train.micro_batch_size=4", "train.seq_len=2048"])
    ref = from_profile(load_profile("h100_assumed"), at_360m)
    assert fwd == pytest.approx([4 * x for x in ref.forward]) and bwd == pytest.approx([4 * x for x in ref.backward])
    assert 3.5 < fwd[-1] / fwd[1] < 4.5 and fwd[0] == 0.0
    assert layer_costs(compose(["model=tiny"])) is None  # no profile: per-stage stand-in or real compute


@pytest.mark.parametrize("P", [2, 4, 8])
def test_under_a_standin_profile_balanced_cuts_by_the_waits(P: int) -> None:
    """The tiny model's own FLOPs cut it evenly; under a stand-in profile the waits are its compute, and balanced
    gives the head's stage fewer blocks: the slowest stage waits less than at the even cut."""
    from asyncpipe.engines.pipeline.standin import chunk_seconds, stage_standin
    from asyncpipe.standin_costs import layer_costs

    cfg = compose([*STANDIN_360M, f"pipeline.stages={P}"])
    fwd, bwd = layer_costs(cfg)
    total = [f + b for f, b in zip(fwd, bwd)]
    cut = cut_blocks(cfg)
    assert cut == balanced_blocks(total, P) and cut[-1] < cut[0]
    assert cut_blocks(compose(["model=tiny", "model.n_layer=32", f"pipeline.stages={P}"])) == even_blocks(32, P)
    assert max(chunk_costs(total, cut)) < max(chunk_costs(total, even_blocks(32, P)))
    per_f, per_b = chunk_seconds(cfg)
    assert [f + b for f, b in zip(per_f, per_b)] == pytest.approx(chunk_costs(total, cut))
    # each rank pads to its own stage's sums (`PipeSettings.standin`); a V's rank to each of its two chunks'
    assert [stage_standin(cfg, r) for r in range(P)] == [pytest.approx((per_f[r], per_b[r])) for r in range(P)]
    v_shape = ["pipeline.schedule=dualpipev", "delay=0", f"train.micro_batches={2 * P}", f"train.eval_batches={2 * P}"]
    v = compose([*STANDIN_360M, f"pipeline.stages={P}", *v_shape])
    vf, vb = chunk_seconds(v)
    assert len(vf) == 2 * P
    assert stage_standin(v, 0) == pytest.approx((vf[0], vb[0], vf[-1], vb[-1]))
    per_stage = ["model=tiny", "engine=pipeline", "pipeline.standin.forward_s=0.02", "pipeline.standin.backward_s=0.04"]
    assert stage_standin(compose(per_stage), 1) == (0.02, 0.04)


@pytest.mark.parametrize(
    "extra, says",
    [
        (["pipeline.standin.profile=nope"], "no such stand-in profile; give a YAML path or one of: 360m_h100"),
        (["pipeline.standin.profile=360m_h100", "pipeline.standin.forward_s=0.02"], "not both"),
        (["pipeline.standin.profile=360m_h100", "pipeline.standin.scale=0"], "scale=0.0 must be a number in (0, 1000]"),
        (["pipeline.standin.profile=360m_h100", "engine=simulate"], "runs only in engine=pipeline"),
    ],
)
def test_a_bad_standin_profile_is_one_line(extra: list[str], says: str) -> None:
    with pytest.raises(ConfigError) as err:
        compose(["model=tiny", "engine=pipeline", *extra])
    assert says in str(err.value) and "\n" not in str(err.value)
