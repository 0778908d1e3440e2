"""Tied embeddings on the pipeline engine (`engines.pipeline.tied`): the head's copy starts equal to the embedding,
the plan counts the matrix on both stages, what cannot run is one line, loss parity with the simulator at P = 4
(sync, 2BW, 2BW + EF, PACI) and PACI at P = 2, and a resumed tied run is bit for bit the one not interrupted (2BW and
PACI, P = 2 and 4). Parity at P = 2 and with replicas for the others: tests/test_pipe_parity.py (`-k tied`)."""

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
        (
            ["pipeline.schedule=paci-recompute", "delay=1"],
            "ties embeddings across stages under 1f1b, 2bw and paci only",
        ),
        (["pipeline.schedule=pipedream"], "ties embeddings across stages under 1f1b, 2bw and paci only"),
        (["delay=1", "pipeline.clip=stage"], "need pipeline.clip=global under pipeline.schedule=2bw"),
        (["pipeline.torch_schedule=zbv"], "pipeline.torch_schedule=zbv splits its backward"),
    ],
)
def test_what_tied_embeddings_cannot_run_is_one_line(extra: list, says: str) -> None:
    with pytest.raises(ConfigError) as err:
        compose([*TIED, *extra])
    assert says in str(err.value) and "model.tie_embeddings=false" in str(err.value) and "\n" not in str(err.value)


def test_which_schedules_read_the_simulators_tied_matrix() -> None:
    """Each copy reads its own stage's versions: the simulator's one matrix under 1F1B, 2BW and PACI in place (its
    last stage never straddles), not where the last stage straddles or the two ends are stale by different steps."""
    from dataclasses import replace

    from asyncpipe.partition import ends_read_one_version
    from asyncpipe.schedules import get

    paci = get("paci")
    head_straddles = replace(paci, versions=lambda P, m, s, k: paci.versions(P + 1, m, s, k))
    for P, m in ((2, 2), (4, 4), (4, 6)):
        named = {n: ends_read_one_version(get(n), P, m) for n in ("1f1b", "2bw", "paci", "paci-recompute", "pipedream")}
        assert named == {"1f1b": True, "2bw": True, "paci": True, "paci-recompute": False, "pipedream": False}
        assert not ends_read_one_version(head_straddles, P, m)
    cfg = compose([*TIED, "pipeline.schedule=paci", "delay=1", "pipeline.clip=stage"])
    assert cfg.model.tie_embeddings and cfg.pipeline.schedule == "paci"


# -- parity with the simulator (slow: one launch per world size) -------------------------------------------------
STEPS = 10
PARITY = ["model=tiny", "model.tie_embeddings=true", "engine=pipeline", "precision=fp32", "device=cpu",
          f"train.steps={STEPS}", "train.micro_batch_size=4", "train.seq_len=32", "train.eval_every=5",
          "train.eval_batches=4", "train.warmup_frac=0.2", "pipeline.threads=1", "run.dir=unused",
          "train.micro_batches=4"]  # fmt: skip
# lr 4e-3: the two copies' gradients are summed in another order than the simulator's one matrix adds them (see
# tests/test_pipe_parity.py's tied fixture); grad_clip 0.5 clips every stage at most steps (PACI: per stage, the
# copy by stage 0's norm).
SCHEDULES = {
    "1f1b": ["delay=0", "optimizer=adamw"],
    "2bw": ["delay=1", "optimizer=adamw"],
    "2bw+ef": ["delay=1", "optimizer=adamw_ef"],
    "paci": ["pipeline.schedule=paci", "delay=1", "pipeline.clip=stage", "optimizer=adamw"],
    "paci+ef": ["pipeline.schedule=paci", "delay=1", "pipeline.clip=stage", "optimizer=adamw", "compensation=ef"],
}


def _parity_cfg(name: str, stages: int):
    return compose([*PARITY, f"pipeline.stages={stages}", *SCHEDULES[name], "optimizer.lr=4e-3", "train.grad_clip=0.5"])


def _simulate(cfg) -> tuple[list, float]:
    import torch
    from omegaconf import OmegaConf

    from asyncpipe.trainer import Trainer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks run one thread each: the same summation order in every matmul
    try:
        trainer = Trainer(OmegaConf.merge(cfg, {"engine": "simulate"}))
        return [trainer.engine.train_step() for _ in range(STEPS)], trainer.evaluate()
    finally:
        torch.set_num_threads(threads)


def _assert_parity(names: list, stages: int) -> None:
    from asyncpipe.spawn import Job, launch

    cfgs = [_parity_cfg(n, stages) for n in names]
    results = launch([Job(c, None, show_progress=False) for c in cfgs], timeout_s=500)
    for name, cfg, result in zip(names, cfgs, results):
        sim, sim_val = _simulate(cfg)
        hist = result["history"]
        assert [h["step"] for h in hist] == list(range(1, STEPS + 1)), name
        gap = max(abs(h["train_loss"] - s.train_loss) for h, s in zip(hist, sim))
        print(f"tied parity {name} P={stages}: max |loss - simulator's| = {gap:.3g}")
        for h, s in zip(hist, sim):
            assert h["train_loss"] == pytest.approx(s.train_loss, rel=1e-5), (name, h["step"])
            assert h["grad_norm"] == pytest.approx(s.grad_norm, rel=1e-5), (name, h["step"])
        assert result["final_val_loss"] == pytest.approx(sim_val, rel=1e-5), name
        assert sum(h["grad_norm"] > 0.5 for h in hist) >= STEPS // 2, name  # the clip bites
        assert hist[0]["train_loss"] - hist[-1]["train_loss"] > 0.1, name  # it trains
        if name.startswith("paci"):
            straddled = sorted((st["stage"], st["straddled_backwards"]) for st in result["stages"])
            assert straddled == [(s, (stages - 1 - s) * (STEPS - 1)) for s in range(stages)]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_tied_at_four_stages_matches_the_simulator() -> None:
    """engine=pipeline at P = 4, tied (stage 0's embedding, stage 3's copy), against the simulator's one matrix:
    sync (1F1B), 2BW, 2BW + EF and PACI in place, every loss and norm and the evaluation within 1e-5."""
    _assert_parity(["1f1b", "2bw", "2bw+ef", "paci"], 4)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tied_paci_at_two_stages_matches_the_simulator() -> None:
    """P = 2, PACI and PACI + EF (sync, 2BW and 2BW + EF at P = 2: tests/test_pipe_parity.py -k tied)."""
    _assert_parity(["paci", "paci+ef"], 2)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "schedule, stages, kept",
    [("2bw", 2, [3, 4]), ("2bw", 4, [3, 4]), ("paci", 4, [4])],  # kept: the stash's versions (PACI at P = 2, untied:
    # tests/test_pipe_paci.py)
)
def test_a_resumed_tied_run_is_bit_identical(tmp_path, schedule: str, stages: int, kept: list) -> None:
    """Both copies of the matrix are equal bit for bit at every version a checkpoint keeps, and a run resumed from
    it reproduces every loss of the run not interrupted (PACI: stage 0's first forwards after the checkpoint run
    again on the W(3) it kept, the embedding's copy included; per-stage clipping, the copy by stage 0's norm)."""
    import shutil

    from helpers import asyncpipe, losses

    sized = [o for o in TIED if not o.startswith(("pipeline.stages=", "train.micro_batches="))]
    run = [*sized, *SCHEDULES[schedule], f"pipeline.stages={stages}", f"train.micro_batches={stages}",
           "train.steps=8", "checkpoint.every=4", "train.eval_every=4", "device=cpu", "precision=fp32",
           "pipeline.threads=1", "optimizer.lr=4e-3", "train.grad_clip=0.5"]  # fmt: skip
    ref = tmp_path / "ref"
    done = asyncpipe("train", *run, f"run.dir={ref}")
    assert done.returncode == 0, done.stderr[-2000:]
    import torch

    ckpt = ref / "checkpoints" / "step_00000004"
    saved = [torch.load(ckpt / f"rank{r}.pt", weights_only=False)["state"] for r in (0, stages - 1)]
    first, last = (x["stash"]["versions"] for x in saved)
    assert sorted(first) == sorted(last) == kept
    for v in first:  # the embedding leads stage 0's parameters; the head's copy, then its norm, end the last stage's
        assert torch.equal(first[v][0], last[v][-2]) and last[v][-2].shape == (256, 64)
    if schedule == "paci":  # stage 0 kept W(3) for its straddlers; the last stage never straddles
        assert saved[0]["previous"] is not None and saved[1]["previous"] is None
        assert not torch.equal(saved[0]["previous"][0], first[4][0])
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
