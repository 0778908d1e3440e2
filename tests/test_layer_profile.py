"""The embedding's share of stage 0 in a real-compute calibration: `bench pipeline` times one layer of each kind
alone (`asyncpipe.bench.layer_profile`) and `cost_source.from_bench` splits stage 0's measured time between the
embedding and its blocks by that share (files without a profile: the embedding free, as before)."""

from __future__ import annotations

import pytest

from asyncpipe.timelines.cost import predict


def _record(profile: dict | None) -> dict:
    """A P = 2, m = 4 small-model 1F1B record (8 blocks, cut 4,4): stage 0 forward 0.05 s and backward 0.11 s per
    micro-batch, stage 1 0.09 s and 0.2 s; 3 steps, eval_batches=1 (two eval forwards per job)."""
    steps, m = 3, 4
    forwards = steps * m + 2
    ops = [
        {"ForwardPass": f * forwards, "BackwardPass": b * steps * m, "OptimizerStep": 0.0, "ReduceGrads": 0.0}
        for f, b in ((0.05, 0.11), (0.09, 0.2))
    ]
    v = {"seconds_by_op_per_stage": ops, "seconds_blocked_in_per_stage": [{}, {}], "step_time_s": 2.0}
    rec = {
        "model": "small",
        "stages": 2,
        "micro_batches": m,
        "steps_per_job": steps,
        "micro_batch_size": 8,
        "seq_len": 64,
        "overrides": ["model=small"],
        "variants": {"1f1b": v},
    }
    if profile is not None:
        rec["layer_profile"] = profile
    return rec


def test_the_embedding_takes_its_measured_share_of_stage_zero() -> None:
    """Embedding forward 0.1 x a block's, backward 0.75 x: stage 0 = e + 4 blocks, so a block's forward is
    0.05 / 4.1 and its backward 0.11 / 4.75, the embedding those times 0.1 and 0.75; both stages keep their measured
    totals (stage 1's head takes what its 4 blocks leave); without a profile the embedding is free (0.05 / 4)."""
    from asyncpipe.timelines.cost_source import from_bench

    prof = {"embedding": [0.001, 0.0075], "block": [0.01, 0.01], "head": [0.5, 0.5]}  # only the ratios are read
    model = from_bench(_record(prof), fit=False)
    assert model.forward[1] == pytest.approx(0.05 / 4.1) and model.backward[1] == pytest.approx(0.11 / 4.75)
    assert model.forward[0] == pytest.approx(0.1 * 0.05 / 4.1) and model.backward[0] == pytest.approx(
        0.75 * 0.11 / 4.75
    )
    assert sum(model.forward[:5]) == pytest.approx(0.05) and sum(model.backward[:5]) == pytest.approx(0.11)
    assert sum(model.forward[5:]) == pytest.approx(0.09) and sum(model.backward[5:]) == pytest.approx(0.2)
    free = from_bench(_record(None), fit=False)
    assert free.forward[0] == free.backward[0] == 0.0 and free.backward[1] == pytest.approx(0.11 / 4)


def test_the_share_moves_a_cut_prediction_not_the_calibrating_one() -> None:
    """At the calibrating cut (4,4) the prediction is the same with or without the embedding's share (the stage
    totals are measured); at 7,1 the share moves a block's cost out of stage 0's blocks into the embedding, so the
    7-block stage 0 costs less and stage 1's 1 block + head more than with a free embedding."""
    from asyncpipe.timelines.cost_source import from_bench

    prof = {"embedding": [0.0, 0.005], "block": [0.01, 0.01], "head": [0.1, 0.1]}
    shared, free = from_bench(_record(prof), fit=False), from_bench(_record(None), fit=False)
    even = [predict(x, "1f1b", 2, 4, cut=[4, 4]) for x in (shared, free)]
    assert even[0].step_s == pytest.approx(even[1].step_s, rel=1e-9)
    cut = [predict(x, "2bw", 2, 4, cut=[7, 1]) for x in (shared, free)]
    assert cut[0].backward_s[0] < cut[1].backward_s[0] and cut[0].backward_s[1] > cut[1].backward_s[1]


def test_layer_profile_times_each_kind_on_the_runs_micro_batch() -> None:
    """One layer of each kind timed alone on the run's micro-batch: every figure is a positive time, the micro-batch
    shape is the config's, and the head at a 4,096-token vocabulary (a d x V matmul and the loss) costs more
    forward than the embedding's lookup."""
    from asyncpipe.bench.layer_profile import layer_profile
    from asyncpipe.config import compose

    cfg = compose(["model=tiny", "tokenizer.vocab_size=4096", "train.micro_batch_size=2", "train.seq_len=32"])
    prof = layer_profile(cfg, threads=1, reps=3)
    assert prof["micro_batch"] == [2, 32] and prof["threads"] == 1 and prof["reps"] == 3
    for kind in ("embedding", "block", "head"):
        assert len(prof[kind]) == 2 and all(x >= 0.0 for x in prof[kind]) and prof[kind][0] > 0.0
    assert prof["head"][0] > prof["embedding"][0]
