"""Host reads in the simulator's step (issue 43): the loss, the clip norm and the diagnostics stay on the device
and are read in one transfer every `read_every` steps (every step on the CPU; on CUDA the logging interval). A
run that reads every 3 steps records exactly the numbers of one that reads every step, and agrees on the loss of
the last step read; clipping no longer reads the norm on the host, with the same clipped gradients."""

from __future__ import annotations

import pytest
import torch

from asyncpipe.config import compose
from asyncpipe.optim import clip_grads
from asyncpipe.trainer import Trainer

TINY = ["model=tiny", "precision=fp32", "device=cpu", "train.micro_batch_size=2", "train.seq_len=16",
        "train.micro_batches=2", "train.steps=7", "optimizer=muon", "delay=1", "compensation.name=ef_adaptive",
        "tracker.wandb.mode=disabled"]  # fmt: skip


def _run(read_every: int) -> tuple[list[dict], list[tuple]]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = Trainer(compose(TINY)).engine
        engine.read_every = read_every
        records, agreed = [], []
        for _ in range(7):
            engine.train_step(sync=False)
            seen = engine.agree(False)
            agreed.append((seen.loss_step, seen.loss))
            records += engine.records(synced=False)
        return records + engine.records(synced=True), agreed
    finally:
        torch.set_num_threads(threads)


def test_reading_every_third_step_records_the_same_numbers():
    each, third = _run(1), _run(3)
    drop = lambda recs: [{k: v for k, v in r.items() if k != "step_time"} for r in recs]  # noqa: E731
    assert drop(each[0]) == drop(third[0])  # every record, bit for bit (loss, grad_norm, ef_lam, update norms)
    assert all(isinstance(v, float) for r in third[0] for k, v in r.items() if k != "step")
    assert [s for s, _ in each[1]] == [1, 2, 3, 4, 5, 6, 7]
    assert [s for s, _ in third[1]] == [0, 0, 3, 3, 3, 6, 7]  # the last step always reads
    losses = {r["step"]: r["train_loss"] for r in each[0]}
    assert all(loss == losses[s] for s, loss in third[1] if s)


def test_a_step_result_reads_its_numbers_when_asked():
    engine = Trainer(compose(TINY)).engine
    engine.read_every = 100
    result = engine.train_step(sync=False)
    assert engine.records() == []  # nothing read yet
    assert isinstance(result.train_loss, float) and isinstance(result.grad_norm, float)
    assert [r["step"] for r in engine.records()] == [1]  # reading one read all


@pytest.mark.parametrize("max_norm", [0.5, 5.0, 0.0])
def test_clip_scales_on_the_device_exactly_as_the_host_rule(max_norm):
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (5, 40, 300)]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    grads = [p.grad.clone() for p in params]
    norm = clip_grads(params, max_norm)
    assert torch.is_tensor(norm) and norm.dim() == 0
    host = float(torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)).square().sum().sqrt())
    scale = max_norm / (host + 1e-6)
    want = [x * scale for x in grads] if 0 < max_norm and scale < 1 else grads
    assert all(torch.equal(p.grad, w) for p, w in zip(params, want))
