"""`pipeline.schedule=dualpipev`: DeepSpeed's DualPipeV with our update trains exactly like the simulator (it is
synchronous: delay 0), and the configurations it cannot run are one-line errors."""

from __future__ import annotations

import pytest

from asyncpipe.config import compose
from asyncpipe.errors import ConfigError
from asyncpipe.model import partition, stage_layers

STEPS = 10
BASE = [
    "engine=pipeline", "precision=fp32", "device=cpu", f"train.steps={STEPS}", "train.micro_batch_size=4",
    "train.seq_len=32", "train.eval_every=5", "train.eval_batches=4", "train.warmup_frac=0.2",
    "pipeline.threads=1", "run.dir=unused", "pipeline.schedule=dualpipev", "delay=0", "pipeline.stages=2",
]  # fmt: skip


def test_v_shaped_layers() -> None:
    parts, mine = stage_layers(10, 2, 0, v_shape=True)
    assert parts == partition(10, 4) == [0, 3, 5, 7, 10]
    assert mine == [0, 1, 2, 7, 8, 9]  # rank 0: embedding + 2 blocks, and 2 blocks + head
    assert stage_layers(10, 2, 1, v_shape=True)[1] == [3, 4, 5, 6]
    assert stage_layers(10, 2, 1)[1] == list(range(5, 10))


@pytest.mark.parametrize("extra,match", [
    (["delay=1"], "synchronous"),
    (["train.micro_batches=2"], "2 x pipeline.stages"),
    (["train.micro_batches=4", "train.eval_batches=2"], "2 x pipeline.stages"),
])  # fmt: skip
def test_what_dualpipev_cannot_run_is_a_config_error(extra: list, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        compose(["model=tiny", *BASE, *extra])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_dualpipev_matches_the_simulator() -> None:
    import torch
    from omegaconf import OmegaConf

    from asyncpipe.spawn import Job, launch
    from asyncpipe.trainer import Trainer

    # m = 6 training micro-batches against 4 evaluation ones: the two schedules' buffers differ.
    # At the lr this parity was validated at (v3's tiny AdamW winner), not the tuned table's default for this regime
    # (5e-3 since 1f43965, where the engines part by 5e-5 relative at step 9: summation order under Adam's scaling).
    cfg = compose(["model=tiny", *BASE, "train.micro_batches=6", "optimizer=adamw", "optimizer.lr=0.016"])
    (result,) = launch([Job(cfg, None, show_progress=False)], timeout_s=240)
    sim = Trainer(OmegaConf.merge(cfg, {"engine": "simulate"}))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref = [sim.engine.train_step() for _ in range(STEPS)]
        ref_val = sim.evaluate()
    finally:
        torch.set_num_threads(threads)
    hist = result["history"]
    assert [h["step"] for h in hist] == list(range(1, STEPS + 1))
    for h, s in zip(hist, ref):
        assert h["train_loss"] == pytest.approx(s.train_loss, rel=1e-5), h["step"]
        assert h["grad_norm"] == pytest.approx(s.grad_norm, rel=1e-5), h["step"]
    assert result["final_val_loss"] == pytest.approx(ref_val, rel=1e-5)
    stages = result["stages"]
    assert [round(st["weight_versions_peak"]) for st in stages] == [1, 1]
    # Two chunks per rank: rank 0 holds the embedding and the head, so it carries more weights than rank 1.
    assert stages[0]["param_bytes"] > stages[1]["param_bytes"] > 0
    assert all(st["peak_activation_bytes"] >= 2 * st["activation_bytes_per_micro_batch"] > 0 for st in stages)
