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
    """The tied matrix's place on this rank (``index`` into ``params``, None off the two ranks that hold it) and the
    two-rank all-reduce of its gradient. ``pairs``: per replica, the ranks of the embedding's and the head's
    stage (every rank makes every group, in order, as `torch.distributed.new_group` requires); ``module``: this
    rank's layers."""

    def __init__(self, params: list, module: Any, pairs: list[list[int]]) -> None:
        self.index: Optional[int] = None
        self.group: Any = None
        self.work: Any = None
        self.is_copy = False
        self.params: list = []
        mine = None
        for ranks in pairs:
            group = tdist.new_group(ranks)
            if tdist.get_rank() in ranks:
                self.group, mine = group, ranks
        if mine is None:
            return
        from asyncpipe.model.gpt import Embedding, Head

        self.is_copy = tdist.get_rank() == mine[1]
        kind = Head if self.is_copy else Embedding
        held = [m.weight for m in module.modules() if isinstance(m, kind) and (not self.is_copy or m.tied_copy)]
        if len(held) != 1:
            raise RuntimeError(f"rank {tdist.get_rank()}: expected one tied matrix, found {len(held)}")
        self.index = next(i for i, p in enumerate(params) if p is held[0])
        self.params = params

    @classmethod
    def of_deepspeed(cls, engine: Any, on: bool) -> "TiedGrads":
        """DeepSpeed's engine: stage 0 and stage P-1 of each replica (``on``: the model ties them across stages)."""
        P, topo = engine.num_stages, engine.grid.topology()
        replicas = engine.grid.get_data_parallel_world_size()
        pairs = [[topo.get_rank(pipe=0, data=d), topo.get_rank(pipe=P - 1, data=d)] for d in range(replicas)]
        return cls(engine.stash.params, engine.module, pairs if on else [])

    @classmethod
    def of_torch(cls, params: list, module: Any, sched: Any, stages: int, tied: bool) -> "TiedGrads":
        """PyTorch's schedules (one replica): the ranks holding the first chunk and the last, when they differ."""
        from asyncpipe.torch_schedules import rank_chunks

        n = stages * sched.chunks
        first, last = ([r for r in range(stages) if c in rank_chunks(sched, stages, r)][0] for c in (0, n - 1))
        return cls(params, module, [[first, last]] if tied and first != last else [])

    @property
    def copy(self) -> Optional[torch.Tensor]:
        """The copy held here (the parameter left out of the norm list), or None."""
        return self.params[self.index] if self.is_copy and self.index is not None else None

    def norm_tensors(self, n: int) -> int:
        """How many of this stage's ``n`` tensors enter the model-wide norm list (the copy does not)."""
        return n - 1 if self.is_copy else n

    def counted(self, grads: list) -> list:
        """``grads`` (or parameters) without the copy's: the list the norms are taken over."""
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
