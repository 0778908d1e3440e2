"""PyTorch's own pipeline schedules (`pipeline.torch_schedule`, `asyncpipe.engines.pipeline.torch_engine`): the same
model, cut and update as DeepSpeed's engine, so a synchronous PyTorch schedule trains exactly like DeepSpeed's 1F1B
(one 2-rank launch, slow); what cannot run says why; the ideal bubble comes from the schedule's own order (pure)."""

from __future__ import annotations

import pytest

from asyncpipe.timelines.torch_orders import ideal_bubble, problem, rank_layers
from asyncpipe.torch_schedules import SCHEDULES, rank_chunks


@pytest.mark.parametrize("m", [2, 4, 8])
def test_ideal_bubbles_from_torchs_own_orders(m: int) -> None:
    # Schedule1F1B is the flushed 1F1B: (P-1)/(m+P-1) at any backward cost.
    assert ideal_bubble(SCHEDULES["1f1b"], 2, m, 2.0) == pytest.approx(1 / (m + 1))
    assert ideal_bubble(SCHEDULES["1f1b"], 2, m, 1.3) == pytest.approx(1 / (m + 1))
    # Two chunks per rank halve the fill; splitting B into input and weight halves shrinks it further.
    one = ideal_bubble(SCHEDULES["1f1b"], 2, m, 2.0)
    inter = ideal_bubble(SCHEDULES["interleaved1f1b"], 2, m, 2.0)
    zbv = ideal_bubble(SCHEDULES["zbv"], 2, m, 2.0)
    assert zbv <= inter < one and (zbv < inter or m == 2)  # at m = 2 ZBV has no steady state to fill
    # Interleaved 1F1B at P=2, m=4 (F = 1/2, B = 1 per chunk): 12 units of work per rank in a batch of 13.
    assert ideal_bubble(SCHEDULES["interleaved1f1b"], 2, 4, 2.0) == pytest.approx(1 / 13)


def test_what_cannot_run_says_why() -> None:
    why = problem(SCHEDULES["dualpipev"], 2, 2)
    assert why is not None and "ScheduleDualPipeV" in why and "m=2" in why and "at least as many microbatches" in why
    assert problem(SCHEDULES["dualpipev"], 2, 4) is None and problem(SCHEDULES["zbv"], 2, 2) is None


def test_v_and_loop_placements_cut_like_deepspeed() -> None:
    n = 4 + 2  # tiny: embedding, 4 blocks, head
    # One chunk per rank: exactly DeepSpeed's stages (asyncpipe.model.partition).
    assert [rank_layers(SCHEDULES["1f1b"], n, 2, r) for r in (0, 1)] == [[0, 1, 2], [3, 4, 5]]
    # A V: rank 0 holds the first and last chunk (embedding and head); a loop: chunks r and r + P.
    assert rank_chunks(SCHEDULES["zbv"], 2, 0) == [0, 3] and rank_chunks(SCHEDULES["interleaved1f1b"], 2, 0) == [0, 2]
    assert rank_layers(SCHEDULES["zbv"], n, 2, 0) == [0, 1, 4, 5]
    assert rank_layers(SCHEDULES["interleaved1f1b"], n, 2, 0) == [0, 1, 3]


@pytest.mark.parametrize("override, message", [
    (["delay=1"], "is synchronous; use it with delay=0"),
    (["pipeline.torch_schedule=gpipe"], "pipeline.torch_schedule=gpipe is not allowed; choose one of: 1f1b"),
    (["pipeline.data_parallel=2"], "one replica"),
    (["optimizer=adamw_ef"], "no stale weights"),
])  # fmt: skip
def test_bad_torch_schedule_configs_are_one_line(override: list[str], message: str) -> None:
    from asyncpipe.config import compose
    from asyncpipe.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        compose(["engine=pipeline", "delay=0", "pipeline.torch_schedule=zbv", *override])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_pytorch_schedules_train_like_deepspeeds_1f1b() -> None:
    """DeepSpeed's 1F1B, PyTorch's Schedule1F1B and ScheduleZBVZeroBubble in one 2-rank launch: the same losses,
    gradient norms and val loss (fp32, tolerance as in test_pipe_parity)."""
    from asyncpipe.config import compose
    from asyncpipe.spawn import Job, launch

    base = ["engine=pipeline", "precision=fp32", "device=cpu", "train.steps=4", "train.micro_batch_size=4",
            "train.seq_len=32", "train.eval_every=2", "train.eval_batches=2", "train.warmup_frac=0.2",
            "pipeline.threads=1", "run.dir=unused", "pipeline.stages=2", "delay=0", "train.micro_batches=4"]  # fmt: skip
    names = [None, "1f1b", "zbv"]
    cfgs = [compose(base + ([f"pipeline.torch_schedule={n}"] if n else [])) for n in names]
    ref, *others = launch([Job(c, None, show_progress=False) for c in cfgs], timeout_s=300)
    assert [h["step"] for h in ref["history"]] == [1, 2, 3, 4]
    for name, res in zip(names[1:], others):
        assert res["status"] == "completed", name
        assert res["stages"][0]["torch_schedule"] == SCHEDULES[name].cls  # it really ran PyTorch's schedule
        for h, r in zip(res["history"], ref["history"]):
            assert h["train_loss"] == pytest.approx(r["train_loss"], rel=1e-5), (name, h["step"])
            assert h["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-5), (name, h["step"])
            assert h["lr"] == pytest.approx(r["lr"], rel=1e-9)
        assert res["final_val_loss"] == pytest.approx(ref["final_val_loss"], rel=1e-5), name
    # The losses move: parity is not four equal numbers.
    assert ref["history"][0]["train_loss"] - ref["history"][-1]["train_loss"] > 0.5
