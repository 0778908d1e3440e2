"""Why the cost model predicts DualPipeV faster than the stand-in mode measures it at depth (issue 52): a diagnostic.

The cost model replays DualPipeV's one-batch op order by data dependencies (`timelines.orders.replay`): an op's
result is on the next rank `p2p_s` after the op ends. DeepSpeed's `DualPipeVSchedule`, which the engine runs, sends
a result only at the rank's next `CommitP2P`, and in its overlapped steps (F0 F1, B1 F1, F0 B1 F1 B0, ...) that
commit comes after the other pass of the pair: the consumer waits a pass longer. The missing term is that delay,
present with free overheads too (the ideal below). This script replays DeepSpeed's own instruction ticks with their
commits (a send or receive completes when both sides have posted theirs, as gloo's batch_isend_irecv), at the cost
model's stand-in calibration (the committed `benchmarks/results/cost-standin.json`, `cost_source.from_standin`),
against the measured DualPipeV records and the model's prediction.

    OMP_NUM_THREADS=1 nice -n 10 .venv/bin/python benchmarks/dualpipev_ticks.py

A diagnostic, not the model: the fix belongs in the one replay (`timelines.timeline.simulate` running DualPipeV's
instruction streams with their phases), with the streams written out torch-free beside `schedules.dualpipev`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
RECORDS = REPO / "benchmarks" / "results" / "cost-standin.json"


def _ticks(P: int, m: int) -> list[list]:
    from deepspeed.runtime.pipe.schedule import DualPipeVSchedule

    return [
        [cmd for tick in DualPipeVSchedule(micro_batches=m, stages=P, stage_id=r) for cmd in tick] for r in range(P)
    ]


def _channel(cmd, r: int) -> tuple[tuple, str]:
    from deepspeed.runtime.pipe.schedule import RecvActivation, RecvGrad, SendActivation, SendGrad

    phase = cmd.kwargs.get("phase", 0)
    down, up = (r + 1, r - 1) if phase == 0 else (r - 1, r + 1)
    kinds = {
        SendActivation: (("act", phase, r, down), "send"),
        RecvActivation: (("act", phase, up, r), "recv"),
        SendGrad: (("grad", phase, r, up), "send"),
        RecvGrad: (("grad", phase, down, r), "recv"),
    }
    return kinds[type(cmd)]


def replay(P: int, m: int, fwd: list[float], bwd: list[float], overhead: float, latency: float) -> float:
    """The batch's makespan: every instruction costs ``overhead``, a pass its chunk's cost, and a commit ends when
    every send and receive it posts has its partner posted (+ ``latency``)."""
    from deepspeed.runtime.pipe.schedule import BackwardPass, CommitP2P, ForwardPass

    streams = _ticks(P, m)
    pc, clock = [0] * P, [0.0] * P
    queued: list[list] = [[] for _ in range(P)]
    waiting: list = [None] * P
    posted: dict = {}
    while any(pc[r] < len(streams[r]) or waiting[r] is not None for r in range(P)):
        moved = False
        for r in range(P):
            while True:
                if waiting[r] is not None:
                    sides = [(posted[ch]["recv" if side == "send" else "send"], i, t) for ch, side, i, t in waiting[r]]
                    if any(len(other) <= i for other, i, _ in sides):
                        break
                    end = max([clock[r]] + [max(t, other[i]) for other, i, t in sides])
                    clock[r], waiting[r], moved = end + (latency if sides else 0.0), None, True
                if pc[r] >= len(streams[r]):
                    break
                cmd = streams[r][pc[r]]
                pc[r], moved = pc[r] + 1, True
                clock[r] += overhead
                if isinstance(cmd, CommitP2P):
                    waiting[r] = []
                    for c in queued[r]:
                        ch, side = _channel(c, r)
                        mine = posted.setdefault(ch, {"send": [], "recv": []})[side]
                        mine.append(clock[r])
                        waiting[r].append((ch, side, len(mine) - 1, clock[r]))
                    queued[r] = []
                elif isinstance(cmd, (ForwardPass, BackwardPass)):
                    chunk = r if cmd.kwargs.get("phase", 0) == 0 else 2 * P - 1 - r
                    clock[r] += fwd[chunk] if isinstance(cmd, ForwardPass) else bwd[chunk]
                elif "Send" in type(cmd).__name__ or "Recv" in type(cmd).__name__:
                    queued[r].append(cmd)
        if not moved:
            raise RuntimeError("deadlock")
    return max(clock)


def main() -> None:
    from asyncpipe.timelines.cost import predict, stage_costs
    from asyncpipe.timelines.cost_source import from_standin, model_at, standin_calibration

    run = json.loads(RECORDS.read_text())
    fitted = from_standin(standin_calibration(run["records"]), 2, RECORDS.name)
    print(
        f"calibration: {fitted.label}; overhead {fitted.overhead_s * 1e3:.2f} ms/instruction, "
        f"{fitted.p2p_s * 1e3:.2f} ms/exchange"
    )
    print("| P | m | measured ms | model ms (error) | ticks replayed ms (error) | ideal: orders / ticks ms |")
    print("|---|---|---|---|---|---|")
    for r in [x for x in run["records"] if x["schedule"] == "dualpipev"]:
        P, m, meas = r["stages"], r["micro_batches"], r["step_time_s"]
        model = model_at(fitted, P)
        pred = predict(model, "dualpipev", P, m).step_s
        fwd, bwd, upd, _ = stage_costs(model, P, 2)
        ticks = replay(P, m, fwd, bwd, fitted.overhead_s, fitted.p2p_s) + fitted.allreduce_latency_s + max(upd)
        F, B = r["forward_s"] / 2, r["backward_s"] / 2
        ideal = replay(P, m, [F] * 2 * P, [B] * 2 * P, 0.0, 0.0)
        print(
            f"| {P} | {m} | {meas * 1e3:.1f} | {pred * 1e3:.1f} ({pred / meas - 1:+.1%}) | {ticks * 1e3:.1f} "
            f"({ticks / meas - 1:+.1%}) | {r['ideal_step_s'] * 1e3:.1f} / {ideal * 1e3:.1f} |"
        )


if __name__ == "__main__":
    main()
