"""Per-stage clipping (`pipeline.clip=stage`) on the simulator under schedules with one version per stage (1F1B,
2BW): one norm per stage of the pipeline's cut, as engine=pipeline takes them. The simulator used to clip these
globally whatever the setting said."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from asyncpipe.config import compose

STEPS = 6
BASE = [
    "precision=fp32", "device=cpu", f"train.steps={STEPS}", "train.micro_batch_size=4", "train.seq_len=32",
    "train.eval_every=3", "train.eval_batches=4", "train.warmup_frac=0.2", "pipeline.threads=1", "run.dir=unused",
    "delay=1", "train.micro_batches=2", "pipeline.stages=2", "train.grad_clip=0.05", "optimizer=adamw",
]  # fmt: skip


def _trainer(cfg):
    from asyncpipe.trainer import Trainer

    return Trainer(OmegaConf.merge(cfg, {"engine": "simulate"}))


def _losses(cfg) -> list[float]:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainer = _trainer(cfg)
        return [trainer.engine.train_step().train_loss for _ in range(STEPS)]
    finally:
        torch.set_num_threads(threads)


def test_stage_clipping_takes_one_norm_per_stage_of_the_cut():
    from asyncpipe.engines.staged import stage_cut

    engine = _trainer(compose(BASE + ["pipeline.clip=stage"])).engine
    groups = engine.clip_groups
    assert len(groups) == 2
    ids = [id(p) for g in groups for p in g]
    assert sorted(ids) == sorted(id(p) for p in engine.model.parameters())  # every parameter once
    parts = stage_cut(engine.model, 2)
    layers = list(engine.model.layers)
    assert {id(p) for p in groups[1]} == {id(p) for layer in layers[parts[1] :] for p in layer.parameters()}
    assert len(_trainer(compose(BASE + ["pipeline.clip=global"])).engine.clip_groups) == 1


def test_stage_and_global_clipping_train_differently_when_the_norm_binds():
    stage = _losses(compose(BASE + ["pipeline.clip=stage"]))
    whole = _losses(compose(BASE + ["pipeline.clip=global"]))
    assert stage[0] == whole[0]  # the first loss is before any update
    assert max(abs(a - b) for a, b in zip(stage, whole)) > 1e-4


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_pipeline_engine_matches_the_simulator_with_stage_clipping_under_2bw():
    from asyncpipe.spawn import Job, launch

    cfg = compose(BASE + ["pipeline.clip=stage"])
    (result,) = launch([Job(OmegaConf.merge(cfg, {"engine": "pipeline"}), None, show_progress=False)], timeout_s=400)
    sim = _losses(cfg)
    assert [h["train_loss"] for h in result["history"]] == pytest.approx(sim, rel=1e-5)
