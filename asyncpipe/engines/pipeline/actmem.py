"""Activation memory of a pipeline stage, measured: the bytes autograd saves for backward during each training
forward (weights excluded), held per in-flight micro-batch until its backward, and their peak over the run.

On a CPU there is no allocator high-water mark to read; this counts exactly what a schedule keeps alive
between a micro-batch's forward and its backward, which is what differs between 1F1B, DualPipeV and 2BW.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Hashable, Iterable, Iterator

import torch


class ActivationMeter:
    """``forward(key)`` wraps one micro-batch's forward, ``backward_done(key)`` releases it; ``peak_bytes`` is
    the most bytes alive at once, ``max_micro_batch_bytes`` the largest single micro-batch."""

    def __init__(self, weights: Callable[[], Iterable[torch.Tensor]]) -> None:
        self._weights = weights  # every weight tensor a forward may read (all stashed versions)
        self._live: dict[Hashable, int] = {}
        self.live_bytes = 0
        self.peak_bytes = 0
        self.max_micro_batch_bytes = 0

    @contextlib.contextmanager
    def forward(self, key: Hashable) -> Iterator[None]:
        if not torch.is_grad_enabled():
            yield
            return
        skip = {w.untyped_storage().data_ptr() for w in self._weights()}
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in skip:
                seen[ptr] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
        self.backward_done(key)  # a slot reused before its backward (never in our schedules) is not double-counted
        total = sum(seen.values())
        if total:
            self._live[key] = total
            self.live_bytes += total
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            self.max_micro_batch_bytes = max(self.max_micro_batch_bytes, total)

    def backward_done(self, key: Hashable) -> None:
        self.live_bytes -= self._live.pop(key, 0)
