"""Tied input and output embeddings across pipeline stages (`model.tie_embeddings` with the embedding on stage 0
and the head on stage P-1, one chunk per rank; a V holds both on rank 0 and ties them in one process).

Each of the two stages holds its own copy of the matrix (`model.build_layers` initialises the head's copy as the
embedding; `Head.tied_copy`). At a batch's `ReduceGrads` the two copies' gradients (the lookup's on stage 0, the
output projection's on stage P-1, each accumulated over the batch's micro-batches) are summed by an all-reduce on
a two-rank group per replica: the gradient of the one tied parameter the simulator's whole model has. Both stages
then take the same update from the same summed gradient, clipping coefficient and optimizer state, so the copies
stay equal bit for bit at every version. The last stage starts its all-reduce without waiting and waits only at its
optimizer step; stage 0, which reaches the cut last, completes it at once.

Which version each copy reads (W(v): the matrix after v updates; batch b holds micro-batches b*m .. b*m+m-1), the
simulator's (`engines.simulator`: one parameter, stage 0's in `engines.staged`, read by the head through
`Head.tied_to`) and so the engine's:

- 1F1B (delay 0): every micro-batch of batch b, forward and backward, on both copies: W(b).
- 2BW, 2BW + EF (delay 1): W(b-1) on both copies (W(-1) = W(0)); the simulator's `DelayedWeights` swaps the one
  matrix to W(b-1) for the whole batch. EF reads W(b-1) from each stage's stash, the same tensor on both.
- PACI (in place, `schedules.paci`): the head's copy (stage P-1, no warm-up, never a straddler) reads W(b) in the
  forward and the backward of every micro-batch of batch b. The embedding's copy reads stage 0's versions: its
  first P-1 micro-batches of batch b >= 1 forward on W(b-1) (before stage 0's step that makes W(b); the simulator copies
  W(b-1) into stage 0's parameters, the matrix included, for that stage's forward only, so the head of the same
  micro-batch still reads W(b)), the rest on W(b). The lookup's backward does not read the matrix (its gradient is
  the output gradient scattered to the token ids), so every micro-batch's two halves add to batch b's gradient,
  which both copies apply to W(b) at the batch's end. So the last stage waits at its step b for stage 0's half of
  batch b's gradient (the last micro-batch's backward reaching stage 0), before its first forward of batch b+1:
  a dependency untied PACI does not have (about P-1 backward hops per batch on the last stage).
- Any other schedule runs tied only where `partition.ends_read_one_version` holds (paci-recompute and PipeDream do
  not: `partition.tied_problem` refuses them in one line).

Clipping. Global (`pipeline.clip=global`): the last stage's copy is left out of the model-wide norm list, which is
then the simulator's (the tied matrix counted once, where `model.parameters()` lists it: first). Per stage
(`pipeline.clip=stage`, PACI's): the simulator's stages own their layers' parameters, so the matrix is counted in
stage 0's norm and clipped by it; here stage 0 sends its squared stage norm (tied gradient summed) to the last stage
on the same two-rank group, which clips its copy by that norm and the rest of its parameters by its own (the copy
left out of it). Per-stage clipping under 1F1B and 2BW is refused with a tied matrix: the simulator clips those
by one global norm (`partition.tied_problem`).
"""

from __future__ import annotations

from collections import deque
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
        # Per batch reduced here and not yet stepped, oldest first (2BW's deferred step on the last stage reduces
        # batch b+1 before it steps b): [gradient all-reduce, norm all-reduce, stage 0's squared norm].
        self.pending: deque[list] = deque()
        self.shared: Optional[torch.Tensor] = None  # the stepped batch's stage-0 squared norm (per-stage clipping)
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
        work = tdist.all_reduce(grads[self.index], group=self.group, async_op=True)
        if not self.is_copy:
            with waiting("tied_grad_allreduce"):
                work.wait()
            work = None
        self.pending.append([work, None, None])

    def share_norm(self, stage_sq: torch.Tensor) -> None:
        """Per-stage clipping: start sending stage 0's squared stage norm (taken after `reduce`, so over the summed
        matrix) to the copy's rank, on the pair's group (the copy adds zeros: the sum is stage 0's value exactly)."""
        if self.index is None:
            return
        shared = torch.zeros_like(stage_sq) if self.is_copy else stage_sq.detach().clone()
        self.pending[-1][1:] = [tdist.all_reduce(shared, group=self.group, async_op=True), shared]

    def wait(self, waiting: Any) -> None:
        """At the step of the oldest batch reduced: complete its gradient's all-reduce and, under per-stage
        clipping, its norm's."""
        if not self.pending:
            return
        work, norm_work, self.shared = self.pending.popleft()
        if work is not None:
            with waiting("tied_grad_allreduce"):
                work.wait()
        if norm_work is not None:
            with waiting("tied_norm_allreduce"):
                norm_work.wait()

    def clip_groups(self, params: list, norm: Any) -> list[tuple[list, Any]]:
        """What `optim.apply_update` clips together (after `wait`): ``params`` by ``norm``, except that under
        per-stage clipping the copy is clipped by stage 0's norm (`share_norm`) and the rest by this stage's."""
        shared, self.shared = self.shared, None
        if shared is None or not self.is_copy:
            return [(params, norm)]
        return [(self.counted(params), norm), ([self.copy], shared.sqrt())]
