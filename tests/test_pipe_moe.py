"""MoE through the pipeline engine: experts stay inside their stage, every stage's aux losses reach the gradient
as in the simulator, and losses and gradient norms match the simulator to 1e-5 on 2 and 4 stages (1F1B and 2BW,
Muon + EF, so expert-aware Muon and EF run on both sides). Multi-process, hence `slow`."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

STEPS = 12
BASE = [
    "model=moe_tiny", "engine=pipeline", "precision=fp32", "device=cpu", f"train.steps={STEPS}",
    "train.micro_batch_size=4", "train.seq_len=32", "train.eval_every=6", "train.eval_batches=2",
    "train.warmup_frac=0.2", "train.micro_batches=4", "pipeline.threads=1", "run.dir=unused", "optimizer=muon_ef",
    "model.moe.aux_loss_coef=0.1", "model.moe.z_loss_coef=0.01",  # large enough to move the norms
]  # fmt: skip
CASES = [(2, 0), (2, 1), (4, 1)]  # (stages, delay), sorted by stages


def _simulate(cfg):
    import torch

    from asyncpipe.trainer import Trainer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks run one thread each: the same matmul summation order
    try:
        trainer = Trainer(OmegaConf.merge(cfg, {"engine": "simulate"}))
        return [trainer.engine.train_step() for _ in range(STEPS)], trainer.evaluate()
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def runs():
    from asyncpipe.config import compose
    from asyncpipe.spawn import Job, launch

    cfgs = [compose(BASE + [f"pipeline.stages={p}", f"delay={d}"]) for p, d in CASES]
    results = []
    for stages in sorted({p for p, _ in CASES}):  # one launch per world size, its configs back to back
        results += launch([Job(c, None, show_progress=False) for c in cfgs if c.pipeline.stages == stages], timeout_s=500)
    return cfgs, results


@pytest.mark.parametrize("i", range(len(CASES)))
def test_moe_pipeline_matches_simulator(runs, i):
    cfgs, results = runs
    cfg, result = cfgs[i], results[i]
    sim, sim_val = _simulate(cfg)
    hist = result["history"]
    assert [h["step"] for h in hist] == list(range(1, STEPS + 1))
    for h, s in zip(hist, sim):
        assert h["train_loss"] == pytest.approx(s.train_loss, rel=1e-5), f"step {h['step']}"
        assert h["grad_norm"] == pytest.approx(s.grad_norm, rel=1e-5), f"step {h['step']}"
        if cfg.delay == 0:  # 1F1B flushes: a step's forwards all precede its optimizer step, as in the simulator
            assert h["moe_lb_loss"] == pytest.approx(s.extras["moe_lb_loss"], rel=1e-5)
            assert h["moe_z_loss"] == pytest.approx(s.extras["moe_z_loss"], rel=1e-5)
        elif "moe_lb_loss" in h:  # 2BW: the forwards since each rank's previous step (none for some steps)
            assert 0.5 < h["moe_lb_loss"] < 4.0
    assert result["final_val_loss"] == pytest.approx(sim_val, rel=1e-5)
    assert {round(st["weight_versions_peak"]) for st in result["stages"]} == {1 + cfg.delay}
