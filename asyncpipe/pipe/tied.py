"""Tied input and output embeddings across pipeline stages (`model.tie_embeddings` with the embedding on stage 0
and the head on stage P-1, one chunk per rank; a V holds both on rank 0 and ties them in one process).

Each of the two stages holds its own copy of the matrix (`model.build_layers` initialises the head's copy as the
embedding; `Head.tied_copy`). At a batch's `ReduceGrads` the two copies' gradients (the lookup's on stage 0, the
output projection's on stage P-1, each accumulated over the batch's micro-batches) are summed by an all-reduce on
a two-rank group per replica: the gradient of the one tied parameter the simulator's whole model has. Both stages
then take the same update from the same summed gradient and the same optimizer state, so the copies stay equal
bit for bit. The last stage starts its all-reduce without waiting and waits only at its optimizer step (where it
already waits for the norm all-reduce); stage 0, which reaches the cut last, completes it at once, so its
per-tensor norm list holds the summed matrix's norm. The last stage's copy is left out of the norm list, which is
then the simulator's (the tied matrix counted once, where `model.parameters()` lists it: first).

Which weights each copy reads: the same version as every other parameter of its stage. Under 1F1B, every
micro-batch of batch b reads W(b) on every stage; under 2BW (delay 1), W(b-1) on every stage; so both copies read
the version the simulator's one tied parameter has at that step (`optim.DelayedWeights`, delay 0 or 1).
Schedules whose stages read different versions of one step (PACI's straddlers, per-stage clipping) are refused in
`config.validate` until the simulator models two copies.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as tdist


class TiedGrads:
    """The tied matrix's place on this rank (``index`` into the stash's parameters, None off the two stages) and
    the two-rank all-reduce of its gradient."""

    def __init__(self, engine: Any, on: bool) -> None:
        self.index: Optional[int] = None
        self.group: Any = None
        self.work: Any = None
        if not on:
            return
        from asyncpipe.model.gpt import Embedding, Head

        P, topo = engine.num_stages, engine.grid.topology()
        for d in range(engine.grid.get_data_parallel_world_size()):  # every rank makes every group, in order
            ranks = [topo.get_rank(pipe=0, data=d), topo.get_rank(pipe=P - 1, data=d)]
            group = tdist.new_group(ranks)
            if tdist.get_rank() in ranks:
                self.group = group
        if self.group is None:
            return
        last = engine.stage_id == P - 1
        kind = Head if last else Embedding
        mine = [m.weight for m in engine.module.modules() if isinstance(m, kind) and (not last or m.tied_copy)]
        if len(mine) != 1:
            raise RuntimeError(f"stage {engine.stage_id}: expected one tied matrix, found {len(mine)}")
        self.index = next(i for i, p in enumerate(engine.stash.params) if p is mine[0])
        self.is_copy = last

    def norm_tensors(self, n: int) -> int:
        """How many of this stage's ``n`` tensors enter the model-wide norm list (the copy does not)."""
        return n - 1 if self.index is not None and self.is_copy else n

    def counted(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """``grads`` without the copy's (the list the norms are taken over)."""
        if self.index is None or not self.is_copy:
            return grads
        return grads[: self.index] + grads[self.index + 1 :]

    def reduce(self, grads: list[torch.Tensor], waiting: Any) -> None:
        """Start summing the matrix's gradient with the other stage's: the copy's rank waits at its step
        (`wait`), stage 0 here, before its norms are taken."""
        if self.index is None:
            return
        self.work = tdist.all_reduce(grads[self.index], group=self.group, async_op=True)
        if not self.is_copy:
            self.wait(waiting)

    def wait(self, waiting: Any) -> None:
        if self.work is not None:
            with waiting("tied_grad_allreduce"):
                self.work.wait()
            self.work = None
