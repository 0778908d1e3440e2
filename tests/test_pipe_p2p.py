"""`BatchedP2P`'s receives posted ahead (gloo): two processes run 2BW's message pattern between two stages (each
commit pairs a send with the matching receive from the same peer). Every tensor arrives in order with its
value, each commit leaves the next receive of its kind posted ahead (none after the run's last micro-batch),
and a receive that does not follow micro-batch order is refused in one line instead of taking another's data."""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp

from asyncpipe.engines.pipeline.p2p import BatchedP2P

N = 6  # micro-batches: micro_batches 3 x total_steps 2


class _Stage(BatchedP2P):
    """What the mixin reads from `ScheduledPipelineEngine`: buffers, stage ids, the schedule and run length."""

    def __init__(self, stage: int) -> None:
        self.stage_id, self.prev_stage, self.next_stage = stage, stage - 1, stage + 1
        self.pipe_buffers = {"inputs": [None], "outputs": [None], "grads": [None]}
        self.grid = SimpleNamespace(stage_to_global=lambda s: s)
        self.device = torch.device("cpu")
        self.spec = SimpleNamespace(stream=object(), chunks=1, in_order=True)
        self.settings = SimpleNamespace(total_steps=2)
        self.micro_batches = 3
        self.init_p2p()

    def _send_tensor_meta(self, out: torch.Tensor, stage: int) -> None:  # DeepSpeed's handshake, on the default group
        torch.distributed.send(torch.tensor(out.shape), stage)

    def _recv_tensor_meta(self, stage: int) -> torch.Tensor:
        shape = torch.zeros(2, dtype=torch.int64)
        torch.distributed.recv(shape, stage)
        return torch.empty(*shape.tolist())


def _run(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    st = _Stage(rank)
    got, ahead = [], []
    if rank == 0:  # per micro-batch: forward, send its activation with the gradient's receive, backward
        for k in range(N):
            st.pipe_buffers["outputs"][0] = torch.full((2, 3), float(k), requires_grad=True)
            st.p2p_send_act(0, k)
            st.p2p_recv_grad(0, k)
            st.p2p_commit()
            got.append(st.pipe_buffers["grads"][0].tolist())
            ahead.append(sorted((kind, k2) for kind, (k2, _, _) in st._ahead.items()))
    else:  # the first activation alone, then each gradient with the next activation's receive
        st.p2p_recv_act(0, 0)
        st.p2p_commit()
        for k in range(N):
            x = st.pipe_buffers["inputs"][0]
            got.append(x.tolist())
            x.grad = -x.detach()
            st.p2p_send_grad(0, k)
            if k + 1 < N:
                st.p2p_recv_act(0, k + 1)
            st.p2p_commit()
            ahead.append(sorted((kind, k2) for kind, (k2, _, _) in st._ahead.items()))
        try:  # micro-batch 2's receive was posted after 1's: asking for another is refused
            st._ahead["act"] = (2, torch.empty(2, 3), None)
            st.p2p_recv_act(0, 3)
            refused = ""
        except RuntimeError as err:
            refused = str(err)
        ahead.append(refused)
    Path(out + f".{rank}").write_text(json.dumps({"got": got, "ahead": ahead, "on": st.p2p_ahead}))
    dist.destroy_process_group()


@pytest.mark.skipif(sys.platform != "linux", reason="gloo over local TCP")
def test_receives_posted_ahead_deliver_in_order_and_none_is_left(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = str(tmp_path / "p2p")
    mp.start_processes(_run, args=(port, out), nprocs=2, start_method="spawn")
    first, second = (json.loads(Path(out + f".{r}").read_text()) for r in (0, 1))
    assert first["on"] and second["on"]
    assert first["got"] == [[[-float(k)] * 3] * 2 for k in range(N)]  # the gradient of micro-batch k
    assert second["got"] == [[[float(k)] * 3] * 2 for k in range(N)]
    # After micro-batch k's commit, k+1's receive is already posted; after the last, none.
    assert first["ahead"] == [[["grad", k + 1]] for k in range(N - 1)] + [[]]
    assert second["ahead"][:-1] == [[["act", k + 2]] for k in range(N - 2)] + [[], []]
    assert "micro-batch order" in second["ahead"][-1]
