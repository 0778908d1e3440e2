"""2BW's messages between stages: each send / receive instruction queues a `torch.distributed.P2POp`, and
`CommitP2P` posts the queued ones together (batched isend/irecv) and waits for them. `BatchedP2P` is a mixin of
`ScheduledPipelineEngine`: it uses DeepSpeed's pipe buffers, stage ids and tensor-meta handshake."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as tdist

from asyncpipe.pipe import schedule as sched


class BatchedP2P:
    """The send / receive / commit handlers of the 2BW instruction stream (`INSTRUCTIONS`)."""

    pipe_buffers: dict
    grid: Any
    device: Any

    def init_p2p(self) -> None:
        self.p2p_ops: list[tdist.P2POp] = []
        self.act_meta_sent = False
        self.act_spec: Optional[tuple] = None

    def p2p_peer(self, stage: int) -> int:
        return self.grid.stage_to_global(stage)

    def p2p_send_act(self, buffer_id: int, micro_batch: int) -> None:
        out = self.pipe_buffers["outputs"][buffer_id]
        if not torch.is_tensor(out):
            raise TypeError("2BW stages exchange exactly one activation tensor")
        if not self.act_meta_sent:
            self._send_tensor_meta(out, self.next_stage)  # blocking; the receiver's first act is this receive
            self.act_meta_sent = True
        self.p2p_ops.append(tdist.P2POp(tdist.isend, out.detach().contiguous(), self.p2p_peer(self.next_stage)))

    def p2p_recv_act(self, buffer_id: int, micro_batch: int) -> None:
        if self.act_spec is None:
            meta = self._recv_tensor_meta(self.prev_stage)
            self.act_spec = (tuple(meta.shape), meta.dtype)
        shape, dtype = self.act_spec
        buf = torch.empty(shape, dtype=dtype, device=self.device, requires_grad=dtype.is_floating_point)
        self.p2p_ops.append(tdist.P2POp(tdist.irecv, buf, self.p2p_peer(self.prev_stage)))
        self.pipe_buffers["inputs"][buffer_id] = buf

    def p2p_send_grad(self, buffer_id: int, micro_batch: int) -> None:
        inputs = self.pipe_buffers["inputs"][buffer_id]
        if inputs.grad is None:
            raise RuntimeError(f"micro-batch {micro_batch}: no input gradient to send")
        self.p2p_ops.append(tdist.P2POp(tdist.isend, inputs.grad, self.p2p_peer(self.prev_stage)))
        self.pipe_buffers["inputs"][buffer_id] = None

    def p2p_recv_grad(self, buffer_id: int, micro_batch: int) -> None:
        out = self.pipe_buffers["outputs"][buffer_id]
        grad = torch.empty_like(out, requires_grad=False)
        self.p2p_ops.append(tdist.P2POp(tdist.irecv, grad, self.p2p_peer(self.next_stage)))
        self.pipe_buffers["grads"][buffer_id] = grad

    def p2p_commit(self) -> None:
        if not self.p2p_ops:
            return
        for req in tdist.batch_isend_irecv(self.p2p_ops):
            req.wait()
        self.p2p_ops = []

    INSTRUCTIONS = {
        sched.SendActivation: p2p_send_act,
        sched.RecvActivation: p2p_recv_act,
        sched.SendGrad: p2p_send_grad,
        sched.RecvGrad: p2p_recv_grad,
        sched.CommitP2P: p2p_commit,
    }
