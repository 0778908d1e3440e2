"""The weights a stage held before its latest optimizer step, kept where a checkpoint needs them to resume PACI
exactly (`asyncpipe.schedules.paci`).

Under PACI a stage s < P-1 forwards the first P-1-s micro-batches of batch b on W(b-1), before the in-place step
that makes W(b). A checkpoint is taken at the cut after that step, so the stage holds W(b) only; a run resumed
from it must forward those micro-batches again, on W(b-1). The stage copies its weights just before the step that
precedes a checkpoint (`keep`, one copy while the checkpoint is written, then dropped), the checkpoint stores them,
and the resumed stream's first forwards run on them (`applied`: W(b-1) copied into the parameters' own storage,
W(b) copied back after, so a straddler's saved weights read W(b) at its backward, as in the run that was not
interrupted). Without a copy (a checkpoint written before this existed) they run on W(b), as they did then.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch


class PreviousWeights:
    """W(v-1) of one stage's ``params`` (the optimizer's handles), when ``needed`` (a stage with straddlers)."""

    def __init__(self, params: list[torch.nn.Parameter], needed: bool) -> None:
        self.params, self.needed = params, needed
        self.tensors: Optional[list[torch.Tensor]] = None
        self.missing = False  # a resumed forward asked for W(v-1) and none was saved (ran on W(v))

    @torch.no_grad()
    def keep(self) -> None:
        """Copy the current weights (call right before the step a checkpoint will follow)."""
        if self.needed:
            self.tensors = [p.detach().clone() for p in self.params]

    def drop(self) -> None:
        self.tensors = None

    def state(self) -> Optional[list[torch.Tensor]]:
        return self.tensors

    def load(self, tensors: Optional[list[torch.Tensor]]) -> None:
        if tensors is not None and len(tensors) != len(self.params):
            raise RuntimeError(f"checkpoint holds {len(tensors)} previous tensors, this stage has {len(self.params)}")
        self.tensors = None if tensors is None else [t.detach().clone() for t in tensors]

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """The block runs on W(v-1) (see `values_in_place`); without a saved copy, on W(v)."""
        if self.tensors is None:
            self.missing = True
            yield
            return
        with values_in_place(self.params, self.tensors):
            yield


@contextlib.contextmanager
def values_in_place(params: list[torch.nn.Parameter], values: list[torch.Tensor]) -> Iterator[None]:
    """The block runs with ``values`` copied into the parameters' own storage; their own values go back in place
    after, so whatever the block's graph saved of a parameter reads the restored values later (what the pipeline's
    in-place step does between a straddler's forward and its backward). Both engines use it."""
    with torch.no_grad():
        latest = [p.detach().clone() for p in params]
        torch._foreach_copy_([p.detach() for p in params], values)
    try:
        yield
    finally:
        with torch.no_grad():
            torch._foreach_copy_([p.detach() for p in params], latest)
