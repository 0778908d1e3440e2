"""2BW's messages between stages: each send / receive instruction queues a `torch.distributed.P2POp`, and
`CommitP2P` posts the queued ones together (batched isend/irecv) and waits for them. `BatchedP2P` is a mixin of
`ScheduledPipelineEngine`: it uses DeepSpeed's pipe buffers, stage ids and tensor-meta handshake.

Receives posted ahead (gloo, one-chunk streams that declare `in_order`: 2BW's and PACI's): once a commit has posted micro-batch k's receive of a kind, it
posts k+1's at once, so a message whose sender is earlier than its receiver is already in the buffer when the
receiver's commit waits. Measured in isolation (`benchmarks/standin_breakdown.py`, docs/performance.md "Where
2BW's time goes"), a receive posted only at the wait costs its receiver 0.6-1.1 ms (median, load 2.4-3.6 on 2
cores) after a sender that came first, one posted ahead 0.02-0.03 ms. Stream messages then go over a process
group of their own, so a receive posted ahead can only ever match a stream message, never DeepSpeed's (tensor
meta, evaluation) on the default group; the run's last micro-batch posts none ahead, so none is left pending at
the end. Not on NCCL: its messages share one stream per communicator, where a receive posted ahead would hold
up this stage's next send behind it."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as tdist

from asyncpipe.schedules import instructions as sched


class BatchedP2P:
    """The send / receive / commit handlers of the 2BW instruction stream (`INSTRUCTIONS`)."""

    pipe_buffers: dict
    grid: Any
    device: Any
    spec: Any
    settings: Any
    micro_batches: int

    def init_p2p(self) -> None:
        """Called by every rank at the same point (it may make a process group)."""
        self.p2p_ops: list[tdist.P2POp] = []
        self.act_meta_sent = False
        self.act_spec: Optional[tuple] = None
        self.p2p_ahead = tdist.get_backend() == "gloo" and self.spec.in_order and self.spec.chunks == 1
        self.p2p_group = tdist.new_group(list(range(tdist.get_world_size()))) if self.p2p_ahead else None
        self._claimed: list[Any] = []  # works of receives posted ahead that this round's instructions took
        self._next: list[tuple] = []  # (kind, micro-batch, buffer maker, peer) to post ahead after this round's
        self._ahead: dict[str, tuple[int, torch.Tensor, Any]] = {}  # kind -> its next receive, posted

    def p2p_peer(self, stage: int) -> int:
        return self.grid.stage_to_global(stage)

    def _op(self, op: Any, tensor: torch.Tensor, peer: int) -> tdist.P2POp:
        return tdist.P2POp(op, tensor, peer, group=self.p2p_group)

    def _recv(self, kind: str, micro_batch: int, make: Any, peer: int) -> torch.Tensor:
        """Micro-batch ``micro_batch``'s receive of ``kind``: the one posted ahead, or a new one queued."""
        ahead = self._ahead.pop(kind, None)
        if ahead is not None:
            k, buf, work = ahead
            if k != micro_batch:
                raise RuntimeError(
                    f"{kind} receive of micro-batch {micro_batch}, but {k}'s was posted ahead: "
                    "a stream posted ahead must receive each kind in micro-batch order"
                )
            self._claimed.append(work)
        else:
            buf = make()
            self.p2p_ops.append(self._op(tdist.irecv, buf, peer))
        if self.p2p_ahead and micro_batch + 1 < self.micro_batches * self.settings.total_steps:
            self._next.append((kind, micro_batch + 1, make, peer))
        return buf

    def p2p_send_act(self, buffer_id: int, micro_batch: int) -> None:
        out = self.pipe_buffers["outputs"][buffer_id]
        if not torch.is_tensor(out):
            raise TypeError("2BW stages exchange exactly one activation tensor")
        if not self.act_meta_sent:
            self._send_tensor_meta(out, self.next_stage)  # blocking; the receiver's first act is this receive
            self.act_meta_sent = True
        self.p2p_ops.append(self._op(tdist.isend, out.detach().contiguous(), self.p2p_peer(self.next_stage)))

    def p2p_recv_act(self, buffer_id: int, micro_batch: int) -> None:
        if self.act_spec is None:
            meta = self._recv_tensor_meta(self.prev_stage)
            self.act_spec = (tuple(meta.shape), meta.dtype)
        shape, dtype = self.act_spec
        make = lambda: torch.empty(shape, dtype=dtype, device=self.device, requires_grad=dtype.is_floating_point)  # noqa: E731
        self.pipe_buffers["inputs"][buffer_id] = self._recv("act", micro_batch, make, self.p2p_peer(self.prev_stage))

    def p2p_send_grad(self, buffer_id: int, micro_batch: int) -> None:
        inputs = self.pipe_buffers["inputs"][buffer_id]
        if inputs.grad is None:
            raise RuntimeError(f"micro-batch {micro_batch}: no input gradient to send")
        self.p2p_ops.append(self._op(tdist.isend, inputs.grad, self.p2p_peer(self.prev_stage)))
        self.pipe_buffers["inputs"][buffer_id] = None

    def p2p_recv_grad(self, buffer_id: int, micro_batch: int) -> None:
        out = self.pipe_buffers["outputs"][buffer_id]
        shape, dtype = out.shape, out.dtype
        make = lambda: torch.empty(shape, dtype=dtype, device=self.device)  # noqa: E731
        grad = self._recv("grad", micro_batch, make, self.p2p_peer(self.next_stage))
        if grad.shape != shape or grad.dtype != dtype:
            raise RuntimeError(
                f"micro-batch {micro_batch}: gradient posted ahead as {tuple(grad.shape)} "
                f"{grad.dtype}, the output is {tuple(shape)} {dtype}"
            )
        self.pipe_buffers["grads"][buffer_id] = grad

    def p2p_commit(self) -> None:
        works = tdist.batch_isend_irecv(self.p2p_ops) if self.p2p_ops else []
        # This round's receives are posted (in order): the next of each kind may go now, ahead of its instruction.
        for kind, k, make, peer in self._next:
            buf = make()
            self._ahead[kind] = (k, buf, tdist.irecv(buf, peer, group=self.p2p_group))
        for req in [*works, *self._claimed]:
            req.wait()
        self.p2p_ops, self._claimed, self._next = [], [], []

    INSTRUCTIONS = {
        sched.SendActivation: p2p_send_act,
        sched.RecvActivation: p2p_recv_act,
        sched.SendGrad: p2p_send_grad,
        sched.RecvGrad: p2p_recv_grad,
        sched.CommitP2P: p2p_commit,
    }
