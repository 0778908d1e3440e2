"""One-batch compute orders per pipeline rank, for the synchronous schedules that are drawn and replayed by data
dependencies (`asyncpipe.timelines.orders.replay`, which runs `plan_streams`, the order as instruction streams, through
the one replay). Pure Python: no torch.

A plan is, per pipeline rank, the order in which it runs forwards (F), backwards (B) and, for zero-bubble
schedules, deferred weight-gradient passes (W) of one batch, on model chunks (virtual stages).

- ``zb-h1``: 1F1B with the backward split into B (input gradient, on the critical path) and W (weight
  gradient); rank r holds back its W's by r backwards and runs them after the last B (Qi et al. 2023).
- ``interleaved-1f1b``: v chunks per rank, chunk c on rank c mod P; forwards go round the chunks in groups of
  P micro-batches, depth first (Narayanan et al. 2021).
- every declared schedule's own ``order`` (1F1B's, read off its stream, in `asyncpipe.schedules.onef1b`;
  DualPipeV's in `asyncpipe.schedules.dualpipev`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

from asyncpipe.errors import UserError
from asyncpipe.schedules.instructions import BackwardPass, ForwardPass, Instruction, WeightPass


class Op(NamedTuple):
    """One pass of a one-batch order (a tuple: hashed and compared at C speed, the replay keys on it)."""

    kind: str  # "F", "B" (whole backward, or input gradient when the plan splits it), "W" (weight gradient)
    chunk: int  # virtual stage: 0 holds the embedding, n_chunks - 1 the loss
    micro_batch: int


@dataclass
class Plan:
    """One batch of a synchronous schedule: each rank's op order and which rank holds each chunk."""

    name: str
    stages: int  # pipeline ranks P
    micro_batches: int
    chunk_rank: list[int]  # chunk -> rank
    ranks: list[list[Op]]
    split_backward: bool = False  # B is the input gradient only and a W op follows

    @property
    def chunks_per_rank(self) -> int:
        return len(self.chunk_rank) // self.stages


def zb_h1(stages: int, micro_batches: int) -> Plan:
    """1F1B order of F and B (input gradient); each W follows a later B so that rank r lags r W's behind,
    and the lagging W's run after the rank's last B, where 1F1B would wait for the drain."""
    ranks = []
    for r in range(stages):
        warm = min(stages - 1 - r, micro_batches)
        ops, done_b, done_w = [Op("F", r, k) for k in range(warm)], 0, 0

        def backward(k: int) -> list[Op]:
            nonlocal done_b, done_w
            out = [Op("B", r, k)]
            done_b += 1
            if done_b > r:  # W of the oldest backward whose W is still pending
                out.append(Op("W", r, done_w))
                done_w += 1
            return out

        for i in range(micro_batches - warm):
            ops += [Op("F", r, warm + i)] + backward(i)
        for k in range(micro_batches - warm, micro_batches):
            ops += backward(k)
        ops += [Op("W", r, k) for k in range(done_w, micro_batches)]
        ranks.append(ops)
    return Plan("zb-h1", stages, micro_batches, list(range(stages)), ranks, split_backward=True)


def interleaved_1f1b(stages: int, micro_batches: int, chunks: int = 2) -> Plan:
    """Megatron's interleaved 1F1B with ``chunks`` model chunks per rank; needs m a multiple of P."""
    P, m, v = stages, micro_batches, chunks
    if m % P:
        raise UserError(f"interleaved-1f1b needs micro-batches divisible by stages (got m={m}, P={P})")
    total = m * v

    def unit(i: int, backward: bool) -> tuple[int, int]:
        """The i-th forward (or backward) unit of a rank: (local chunk, micro-batch), P micro-batches per group."""
        group, j = divmod(i, P * v)
        local = j // P
        return (v - 1 - local if backward else local), group * P + j % P

    ranks = []
    for r in range(P):
        warm = min((P - 1 - r) * 2 + (v - 1) * P, total)
        ops = []
        for i in range(warm):
            c, k = unit(i, False)
            ops.append(Op("F", c * P + r, k))
        for i in range(total - warm):
            c, k = unit(warm + i, False)
            cb, kb = unit(i, True)
            ops += [Op("F", c * P + r, k), Op("B", cb * P + r, kb)]
        for i in range(total - warm, total):
            cb, kb = unit(i, True)
            ops.append(Op("B", cb * P + r, kb))
        ranks.append(ops)
    chunk_rank = [c % P for c in range(P * v)]
    return Plan("interleaved-1f1b", P, m, chunk_rank, ranks)


def drawn_orders() -> dict[str, tuple[Callable[[int, int], Plan], str]]:
    """The orders drawn beside the declared schedules that no config runs, with a note on their bubble."""
    return {"zb-h1": (zb_h1, "B and W split in halves"), "interleaved-1f1b": (interleaved_1f1b, "2 chunks per rank")}


def plans() -> dict[str, Callable[[int, int], Plan]]:
    """The one-batch orders by name, from 1F1B up: every declared schedule's own ``order`` on one chunk per rank,
    the drawn-only orders, then the declared ones over several chunks."""
    from asyncpipe.schedules import schedules

    declared = [s for s in schedules() if s.order is not None]
    out: dict[str, Callable[[int, int], Plan]] = {s.name: s.order for s in declared if s.chunks == 1}
    out.update({name: order for name, (order, _) in drawn_orders().items()})
    out.update({s.name: s.order for s in declared if s.chunks > 1})
    return out


def sync_schedules() -> tuple[str, ...]:
    """The names of the one-batch orders drawn by data dependencies."""
    return tuple(plans())


def plan(name: str, stages: int, micro_batches: int) -> Plan:
    table = plans()
    if name not in table:
        raise UserError(f"unknown synchronous schedule {name!r}; choose one of: {', '.join(table)}")
    if stages < 1 or micro_batches < 1:
        raise UserError("stages and micro-batches must be >= 1")
    return table[name](stages, micro_batches)


def deps(op: Op, n_chunks: int, split_backward: bool) -> list[Op]:
    """The ops whose results ``op`` reads."""
    if op.kind == "F":
        return [Op("F", op.chunk - 1, op.micro_batch)] if op.chunk > 0 else []
    if op.kind == "B":
        own = [Op("F", op.chunk, op.micro_batch)]
        return own + ([Op("B", op.chunk + 1, op.micro_batch)] if op.chunk < n_chunks - 1 else [])
    return [Op("B", op.chunk, op.micro_batch)]


PASSES = {"F": ForwardPass, "B": BackwardPass, "W": WeightPass}  # an op's kind -> its instruction


def plan_streams(p: Plan) -> list[list[Instruction]]:
    """Each rank's order as an instruction stream: one pass per op, on its chunk, naming the ops it reads (`deps`)."""
    n_chunks = len(p.chunk_rank)
    return [
        [
            PASSES[op.kind](
                micro_batch=op.micro_batch, chunk=op.chunk, needs=tuple(deps(op, n_chunks, p.split_backward))
            )
            for op in p.ranks[r]
        ]
        for r in range(p.stages)
    ]


_KINDS = {cls: kind for kind, cls in PASSES.items()}


def op_of(cmd: Instruction) -> Op:
    """The op a pass of `plan_streams` runs."""
    return Op(_KINDS[type(cmd)], cmd.chunk, cmd.micro_batch)  # type: ignore[attr-defined]
