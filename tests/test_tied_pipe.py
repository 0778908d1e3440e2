"""Tied embeddings on the pipeline engine (`asyncpipe.pipe.tied`): the head's copy starts equal to the embedding,
the plan counts the matrix on both stages, what cannot run is one line, and a resumed tied run is bit for bit the
one not interrupted. Loss parity with the simulator: tests/test_pipe_parity.py (`-k tied`)."""

from __future__ import annotations

import pytest

from asyncpipe.config import compose
from asyncpipe.errors import ConfigError

TIED = ["model=tiny", "model.tie_embeddings=true", "engine=pipeline", "pipeline.stages=2", "train.micro_batches=2"]


def test_the_last_stage_builds_a_copy_of_the_embedding() -> None:
    torch = pytest.importorskip("torch")
    from asyncpipe.model import build_layers

    cfg = compose(TIED)
    first = build_layers(cfg.model, 256, seed=3, indices=[0, 1, 2])
    last = build_layers(cfg.model, 256, seed=3, indices=[3, 4, 5])
    whole = build_layers(cfg.model, 256, seed=3)
    assert last[5].tied_copy and not whole[5].tied_copy and whole[5].weight is None
    assert torch.equal(first[0].weight, last[5].weight) and torch.equal(whole[0].weight, last[5].weight)


def test_the_plan_counts_the_tied_matrix_on_both_stages() -> None:
    from asyncpipe.plan import plan

    tied, untied = plan(compose(TIED)), plan(compose([*TIED, "model.tie_embeddings=false"]))
    assert [s.params for s in tied.stages] == [s.params for s in untied.stages]  # a copy on stage 1, as untied
    assert tied.total_params < untied.total_params  # the model itself holds it once
    v = plan(compose([*TIED, "pipeline.schedule=dualpipev", "train.micro_batches=4", "train.eval_batches=4"]))
    assert sum(s.params for s in v.stages) == v.total_params


@pytest.mark.parametrize(
    "extra, says",
    [
        (["pipeline.schedule=paci", "delay=1"], "ties embeddings across stages under 1f1b and 2bw only"),
        (["delay=1", "pipeline.clip=stage"], "need pipeline.clip=global"),
        (["pipeline.torch_schedule=zbv"], "pipeline.torch_schedule=zbv splits its backward"),
    ],
)
def test_what_tied_embeddings_cannot_run_is_one_line(extra: list, says: str) -> None:
    with pytest.raises(ConfigError) as err:
        compose([*TIED, *extra])
    assert says in str(err.value) and "model.tie_embeddings=false" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_a_resumed_tied_2bw_run_is_bit_identical(tmp_path) -> None:
    """Both copies of the matrix are equal bit for bit at every version a checkpoint keeps, and a run resumed from
    it reproduces every loss of the run not interrupted."""
    import shutil

    from helpers import asyncpipe, losses

    run = [*TIED, "delay=1", "train.steps=8", "checkpoint.every=4", "train.eval_every=4", "device=cpu",
           "precision=fp32", "pipeline.threads=1", "optimizer=adamw", "optimizer.lr=4e-3"]
    ref = tmp_path / "ref"
    done = asyncpipe("train", *run, f"run.dir={ref}")
    assert done.returncode == 0, done.stderr[-2000:]
    import torch

    saved = [torch.load(ref / "checkpoints" / "step_00000004" / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    first, last = (x["state"]["stash"]["versions"] for x in saved)
    assert sorted(first) == sorted(last) == [3, 4]  # 2BW's two versions on each stage
    for v in first:  # the embedding leads stage 0's parameters; the head's copy, then its norm, end stage 1's
        assert torch.equal(first[v][0], last[v][-2]) and last[v][-2].shape == (256, 64)
    again = tmp_path / "again"
    shutil.copytree(ref, again)
    (again / "summary.json").unlink()
    for later in (again / "checkpoints").glob("step_*"):  # resume from step 4: steps 5-8 run again
        if later.name != "step_00000004":
            shutil.rmtree(later)
    resumed = asyncpipe("train", *run, f"run.dir={again}", "resume=true")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from" in resumed.stdout and "step 4" in resumed.stdout.split("resumed from")[1].splitlines()[0]
    assert losses(again) == losses(ref)  # exact float equality, every step and evaluation


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_pytorch_schedules_tie_like_deepspeeds_1f1b() -> None:
    """Tied, in one 2-rank launch: DeepSpeed's 1F1B (held to the simulator in test_pipe_parity), PyTorch's
    Schedule1F1B and Interleaved1F1B (the matrix split over rank 0 and rank 1): the same losses, norms and val
    loss."""
    from asyncpipe.spawn import Job, launch

    base = [*TIED, "precision=fp32", "device=cpu", "train.steps=4", "train.micro_batch_size=4", "train.seq_len=32",
            "train.eval_every=2", "train.eval_batches=2", "pipeline.threads=1", "run.dir=unused", "delay=0",
            "train.micro_batches=4", "optimizer=adamw", "optimizer.lr=4e-3"]
    names = [None, "1f1b", "interleaved1f1b"]
    cfgs = [compose(base + ([f"pipeline.torch_schedule={n}"] if n else [])) for n in names]
    ref, *others = launch([Job(c, None, show_progress=False) for c in cfgs], timeout_s=400)
    for name, res in zip(names[1:], others):
        assert res["status"] == "completed", name
        for h, r in zip(res["history"], ref["history"]):
            assert h["train_loss"] == pytest.approx(r["train_loss"], rel=1e-5), (name, h["step"])
            assert h["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-5), (name, h["step"])
        assert res["final_val_loss"] == pytest.approx(ref["final_val_loss"], rel=1e-5), name
    assert ref["history"][0]["train_loss"] - ref["history"][-1]["train_loss"] > 0.1
