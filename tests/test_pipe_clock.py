"""`engines.pipeline.clock.StageClock`: the accounting of wait / compute seconds is the same in both modes, and in
``cuda_events`` mode the seconds come from the events (the stream's view), not the host's clock: a NCCL wait
returns at once on the host while the stream stalls, which the host clock would read as ~0."""

from __future__ import annotations

import time

import torch

from asyncpipe.engines.pipeline.clock import CUDA_EVENTS, HOST, StageClock


class FakeEvent:
    """A CUDA event on a fake stream whose time the test sets: `record` stamps the stream's time now."""

    stream_time = 0.0
    synchronized = 0

    def record(self) -> None:
        self.t = FakeEvent.stream_time

    def elapsed_time(self, end: "FakeEvent") -> float:
        return (end.t - self.t) * 1e3  # milliseconds, as torch.cuda.Event says

    def synchronize(self) -> None:
        FakeEvent.synchronized += 1


def test_cuda_events_time_the_stream_not_the_host():
    clock = StageClock(torch.device("cpu"), event=FakeEvent)
    assert clock.mode == CUDA_EVENTS
    FakeEvent.stream_time = 0.0
    with clock.instruction("ForwardPass", is_wait=False):
        FakeEvent.stream_time += 2.0  # kernels: 2 s of stream time, the host returned at once
    with clock.instruction("CommitP2P", is_wait=True):
        FakeEvent.stream_time += 0.5  # req.wait(): the stream stalls 0.5 s on the receive
    with clock.instruction("OptimizerStep", is_wait=False):
        with clock.waiting("norm_allreduce"):
            FakeEvent.stream_time += 0.25  # work.wait() on the norm all-reduce
        FakeEvent.stream_time += 1.0
    assert clock.totals == {"wait": 0.0, "compute": 0.0}  # nothing read before the step's events complete
    before = FakeEvent.synchronized
    clock.settle()
    assert FakeEvent.synchronized == before + 1  # one wait, on the last event
    assert clock.totals == {"wait": 0.75, "compute": 3.0, "norm_allreduce": 0.25}
    assert clock.by_op == {"ForwardPass": 2.0, "CommitP2P": 0.5, "OptimizerStep": 1.25}
    assert clock.by_wait == {"norm_allreduce": 0.25}


def test_host_mode_on_cpu_counts_as_before():
    clock = StageClock(torch.device("cpu"))
    assert clock.mode == HOST
    with clock.instruction("CommitP2P", is_wait=True):
        time.sleep(0.02)
    with clock.instruction("OptimizerStep", is_wait=False):
        with clock.waiting("norm_allreduce"):
            time.sleep(0.02)
    assert clock.totals["wait"] >= 0.04 and clock.totals["norm_allreduce"] >= 0.02  # read at once, no settle
    assert clock.totals["compute"] < 0.02
    assert StageClock(torch.device("cuda"), host=True).mode == HOST  # trace=true synchronises: host is valid
