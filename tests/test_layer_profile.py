"""A real-compute calibration's split of each stage's measured pass among its layers: `bench pipeline` times one
layer of each kind alone (`asyncpipe.bench.layer_profile`) and `cost_source.from_bench` fits each stage's pass as
the engine's own per-pass seconds + a common scale of its layers' times alone (files without a profile: stage 0's
blocks share its time, the embedding free, the head the rest of the last stage, as before)."""

from __future__ import annotations

import pytest

from asyncpipe.timelines.cost import predict


def _record(profile: dict | None, fwd=(0.05, 0.09), bwd=(0.11, 0.2)) -> dict:
    """A P = 2, m = 4 small-model 1F1B record (8 blocks, cut 4,4) whose stages' passes took ``fwd`` and ``bwd``
    seconds per micro-batch; 3 steps, eval_batches=1 (two eval forwards per job)."""
    steps, m = 3, 4
    forwards = steps * m + 2
    ops = [
        {"ForwardPass": f * forwards, "BackwardPass": b * steps * m, "OptimizerStep": 0.0, "ReduceGrads": 0.0}
        for f, b in zip(fwd, bwd)
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


PROFILE = {"embedding": [0.0, 0.005], "block": [0.01, 0.02], "head": [0.05, 0.1]}


def test_a_stage_is_its_layers_alone_scaled_plus_the_engines_pass() -> None:
    """Stages built by hand from the profile with k = 1.2, c = 4 ms (forward) and k = 0.9, c = 2 ms (backward):
    stage 0 = embedding + 4 blocks alone 0.04 / 0.085 s, measured 0.004 + 1.2 x 0.04 = 0.052 and 0.002 + 0.9 x 0.085
    = 0.0785; stage 1 = 4 blocks + head alone 0.09 / 0.18, measured 0.112 and 0.164. The fit recovers each layer at k
    x its time alone and the engine's pass as ``chunk_s``, and the even cut's stages at their measured times."""
    from asyncpipe.timelines.cost import stage_costs
    from asyncpipe.timelines.cost_source import from_bench

    model = from_bench(_record(PROFILE, fwd=(0.052, 0.112), bwd=(0.0785, 0.164)), fit=False)
    assert model.chunk_s == pytest.approx((0.004, 0.002))
    assert model.forward[0] == pytest.approx(0.0) and model.backward[0] == pytest.approx(0.9 * 0.005)
    assert model.forward[1] == pytest.approx(1.2 * 0.01) and model.backward[1] == pytest.approx(0.9 * 0.02)
    assert model.forward[-1] == pytest.approx(1.2 * 0.05) and model.backward[-1] == pytest.approx(0.9 * 0.1)
    fwd, bwd, _, _ = stage_costs(model, 2)
    assert fwd == pytest.approx([0.052, 0.112]) and bwd == pytest.approx([0.0785, 0.164])


def test_without_a_profile_the_blocks_share_stage_zero_and_a_negative_pass_is_none() -> None:
    """An older file (no profile): stage 0's 4 blocks share its time, the embedding free, no per-pass term. A profile
    whose fit wants a negative engine pass (stages exactly 2 x their layers alone, less 1 ms) fits through the origin
    instead: no per-pass term, k from both stages."""
    from asyncpipe.timelines.cost_source import from_bench

    free = from_bench(_record(None), fit=False)
    assert free.forward[0] == free.backward[0] == 0.0 and free.backward[1] == pytest.approx(0.11 / 4)
    assert free.chunk_s == (0.0, 0.0)
    neg = from_bench(_record(PROFILE, fwd=(2 * 0.04 - 0.001, 2 * 0.09 - 0.001)), fit=False)
    assert neg.chunk_s[0] == 0.0 and 1.9 < neg.forward[1] / 0.01 < 2.0


def test_the_fit_moves_a_cut_prediction_not_the_calibrating_one() -> None:
    """At the calibrating cut (4,4) each stage's pass is its measured one, profile or not; at 7,1 the head's stage,
    1 block + head, keeps its engine pass (which the old split charged to the 4 blocks it subtracted), so it costs
    more than under the old split, and the 7-block stage less."""
    from asyncpipe.timelines.cost import stage_costs
    from asyncpipe.timelines.cost_source import from_bench

    rec = dict(fwd=(0.052, 0.112), bwd=(0.0785, 0.164))
    fitted, old = from_bench(_record(PROFILE, **rec), fit=False), from_bench(_record(None, **rec), fit=False)
    assert stage_costs(fitted, 2, cut=[4, 4])[0] == pytest.approx(stage_costs(old, 2, cut=[4, 4])[0])
    (f0, f1), (o0, o1) = stage_costs(fitted, 2, cut=[7, 1])[0], stage_costs(old, 2, cut=[7, 1])[0]
    assert f1 > o1 and f0 < o0  # stage 0's 7 blocks no longer carry 7/4 of its engine pass


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


def test_the_real_compute_cut_block_in_the_doc_is_the_file_and_todays_model() -> None:
    """docs/performance.md's real-compute cut block is `cut_lines` of the committed bench file, and the cost model
    calibrated on its 1F1B even variant today gives the predictions the file recorded (within 1e-9): the doc's
    figures are today's code on that measurement. Each ratio within 5% of its prediction (issue 52)."""
    import json
    from pathlib import Path

    from asyncpipe.bench.pipeline_cuts import cut_lines
    from asyncpipe.timelines.cost_source import from_bench

    repo = Path(__file__).resolve().parents[1]
    res = json.loads((repo / "benchmarks" / "results" / "cut-real-small-P2.json").read_text())
    doc = (repo / "docs" / "performance.md").read_text()
    block = doc.split("<!-- cut-real:start -->\n")[1].split("<!-- cut-real:end -->")[0]
    assert block == "".join(f"    {line}\n" for line in cut_lines(res))
    model = from_bench(res, "this run", variant="1f1b+even")
    for name, v in res["cuts"]["variants"].items():
        pred = predict(model, v["variant"], 2, 4, clip="global", cut=v["cut"]).step_s
        assert pred == pytest.approx(v["predicted_step_s"], rel=1e-9), name
    assert all(abs(r["error"]) < 0.05 for r in res["cuts"]["ratios"].values())


def test_the_docs_contention_figures_are_the_committed_files() -> None:
    """docs/performance.md's 'a block 0.999x, the head 0.993x' is benchmarks/results/contention.json: each layer's
    fwd+bwd time with two ranks computing at once (their mean) over its time alone."""
    import json
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    res = json.loads((repo / "benchmarks" / "results" / "contention.json").read_text())
    ratio = {
        k: sum(sum(t[k]) for t in res["together"]) / len(res["together"]) / sum(res["alone"][k]) for k in res["alone"]
    }
    doc = " ".join((repo / "docs" / "performance.md").read_text().split())
    assert f"a block {ratio['block']:.3f}x, the head {ratio['head']:.3f}x" in doc
