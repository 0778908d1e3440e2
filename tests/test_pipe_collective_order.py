"""The order of collectives across NCCL communicators under 2BW (issue 43): p2p messages go over the world
communicator, the cross-stage norm all-reduce over the pipe group's, the gradient all-reduce over the data-parallel
group's, and the norm all-reduce is asynchronous, so they overlap. NCCL gives no promise that kernels of several
communicators run at the same time; two ranks that queue two shared operations in opposite orders can hang.

This replays every rank's instruction stream (`TwoBWSchedule`, the engine's own) under the worst case NCCL allows:
each rank runs its communication strictly in the order it queues it, one operation at a time; a batched p2p
exchange completes once every peer has reached its matching messages, an all-reduce once every member reached it.
Every rank finishing means no rank ever waits for an operation that its peer queued behind one waiting for it: the
cross-stage and data-parallel all-reduces of batch b sit between the same two p2p exchanges on every rank.
"""

from __future__ import annotations

import pytest

from asyncpipe.schedules import twobw as sched

P2P = {"SendActivation": (1, "act", "send"), "RecvActivation": (-1, "act", "recv"),
       "SendGrad": (-1, "grad", "send"), "RecvGrad": (1, "grad", "recv")}  # fmt: skip


def queued(P: int, m: int, D: int, steps: int, defer: bool) -> dict[tuple[int, int], list[tuple]]:
    """Per rank (stage, replica): its communication in queue order. A p2p exchange is the frozenset of its
    messages, each named (sender, receiver, kind, n-th such message); an all-reduce names its group and batch."""
    counts: dict[tuple, int] = {}
    out: dict[tuple[int, int], list[tuple]] = {}
    for r in range(D):
        for s in range(P):
            seq, pending = [], []
            for tick in sched.TwoBWSchedule(m, P, s, steps, defer).steps():
                for cmd in tick:
                    kind = type(cmd).__name__
                    if kind in P2P:
                        step, what, side = P2P[kind]
                        pair = ((s, r), (s + step, r)) if side == "send" else ((s + step, r), (s, r))
                        key = (*pair, what, side)
                        n = counts[key] = counts.get(key, -1) + 1
                        pending.append((*pair, what, n))
                    elif kind == "CommitP2P" and pending:
                        seq.append(("p2p", frozenset(pending)))
                        pending = []
                    elif kind == "ReduceGrads":
                        b = cmd.kwargs["batch"]
                        if D > 1:
                            seq.append(("allreduce", ("dp", s), b))
                        seq.append(("allreduce", ("pipe", r), b))
            out[(s, r)] = seq
    return out


def runs_to_the_end(seqs: dict[tuple[int, int], list[tuple]]) -> bool:
    """Replay one operation at a time per rank, in queue order; True when every rank finishes."""
    pos = dict.fromkeys(seqs, 0)
    head = lambda rank: seqs[rank][pos[rank]] if pos[rank] < len(seqs[rank]) else None  # noqa: E731
    members = {}
    for rank, seq in seqs.items():
        for op in seq:
            if op[0] == "allreduce":
                members.setdefault(op[1], set()).add(rank)
    while any(pos[r] < len(seqs[r]) for r in seqs):
        ready = []
        for rank in seqs:
            op = head(rank)
            if op is None:
                continue
            if op[0] == "allreduce":
                if all(head(x) == op for x in members[op[1]]):
                    ready.append(rank)
            else:
                peers = {x for msg in op[1] for x in msg[:2]} - {rank}
                if all(head(x) is not None and head(x)[0] == "p2p" and
                       {msg for msg in op[1] if x in msg[:2]} <= head(x)[1] for x in peers):  # fmt: skip
                    ready.append(rank)
        if not ready:
            return False
        for rank in ready:
            pos[rank] += 1
    return True


@pytest.mark.parametrize("P,m,D", [(2, 2, 1), (2, 4, 1), (3, 3, 1), (4, 4, 1), (4, 8, 1), (2, 2, 2), (3, 4, 2)])
@pytest.mark.parametrize("defer", [False, True])
def test_2bw_queues_shared_operations_in_one_order_on_every_rank(P: int, m: int, D: int, defer: bool) -> None:
    assert runs_to_the_end(queued(P, m, D, 4, defer))


def test_the_replay_catches_opposite_orders() -> None:
    """The check can fail: the last stage queuing batch 0's all-reduce one p2p exchange earlier hangs it."""
    seqs = queued(2, 2, 1, 4, True)
    last = seqs[(1, 0)]
    i = next(i for i, op in enumerate(last) if op[0] == "allreduce")
    j = max(k for k in range(i) if last[k][0] == "p2p")
    last[i], last[j] = last[j], last[i]
    assert not runs_to_the_end(seqs)
