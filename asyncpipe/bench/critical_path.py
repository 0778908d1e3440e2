"""Where a stand-in step's time goes on the critical path (issue 39, item 5): a traced stand-in run's
per-instruction events (`pipeline.trace=true`: ``trace-rank{r}.json``, (op, start, end) on the host's monotonic
clock) walked backwards from the end of a window on stage 0, attributing every second to what held the
pipeline up at that moment. Torch-free.

The walk: on the current stage, going back in time, each instruction's seconds go to its kind (a forward or
backward to its configured stand-in ``wait`` and its ``overshoot`` beyond it), the gaps between instructions to
``between`` (Python in the engine between two instructions, the batch cut, the metrics reporter); a
communication instruction whose peer posted its side of a message later than this stage did is where the path
jumps to that peer: the seconds from the peer's post to this stage's end of the instruction are ``message``
(the message's latency: gloo's wake-up, copy and the receiver's scheduling), and the walk continues on the peer
from the moment it posted. A schedule with no slack (2BW's steady state) has every stage on this path in turn,
so the window's seconds split exactly into these parts.

Messages are matched in order per (sender, receiver, kind): the n-th activation stage s sends is the n-th its
next stage receives (both engines keep that order). 2BW queues sends and receives and posts them in a
`CommitP2P`; DeepSpeed's flushed schedules post each in its own instruction.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

SEND = {"SendActivation": ("act", +1), "SendGrad": ("grad", -1)}  # kind, direction of the peer stage
RECV = {"RecvActivation": ("act", -1), "RecvGrad": ("grad", +1)}
COMPUTE = {"ForwardPass": 0, "BackwardPass": 1}
PARTS = ("wait", "overshoot", "message", "commit", "load", "reduce", "optimizer_step", "other", "cut", "between")


def _posts(events: Sequence[dict]) -> dict[int, list[tuple[str, int]]]:
    """Event index -> the messages it posts ((kind, peer offset) per send or receive): a Send/Recv
    instruction's own (DeepSpeed's blocking p2p), or, where the stream commits (2BW), the CommitP2P's queue."""
    out: dict[int, list[tuple[str, int, bool]]] = {}
    queued: list[tuple[str, int, bool]] = []
    commits = any(e["op"] == "CommitP2P" for e in events)
    for i, e in enumerate(events):
        msg = SEND.get(e["op"]) or RECV.get(e["op"])
        if msg is not None:
            item = (msg[0], msg[1], e["op"] in SEND)
            if commits:
                queued.append(item)
            else:
                out[i] = [item]
        elif e["op"] == "CommitP2P":
            out[i], queued = queued, []
    return out  # type: ignore[return-value]


def match_messages(traces: dict[int, list[dict]]) -> dict[tuple[int, int], list[tuple[int, int]]]:
    """(stage, event index) -> [(peer stage, peer event index)] for every message the event posts."""
    posts = {s: _posts(ev) for s, ev in traces.items()}
    seq: dict[tuple, list[tuple[int, int]]] = {}  # (src, dst, kind, side) -> event indices in order
    for s, by in posts.items():
        for i in sorted(by):
            for kind, off, is_send in by[i]:
                src, dst = (s, s + off) if is_send else (s + off, s)
                seq.setdefault((src, dst, kind, is_send), []).append(i)
    out: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for (src, dst, kind, is_send), idx in seq.items():
        if not is_send:
            continue
        recv = seq.get((src, dst, kind, False), [])
        for a, b in zip(idx, recv):
            out.setdefault((src, a), []).append((dst, b))
            out.setdefault((dst, b), []).append((src, a))
    return out


def _part(op: str) -> str:
    if op in SEND or op in RECV or op == "CommitP2P":
        return "commit"
    return {"LoadMicroBatch": "load", "ReduceGrads": "reduce", "OptimizerStep": "optimizer_step"}.get(op, "other")


def cut_op(events: Sequence[dict]) -> str:
    """The instruction that ends a `train_batch` call: ReduceGrads in a committed stream (2BW, PACI: the cut),
    OptimizerStep in DeepSpeed's flushed schedules. The gap after it is the ``cut``: the engine's return and next
    call, and the trainer's work between them (agreement, metrics, logging)."""
    return "ReduceGrads" if any(e["op"] == "CommitP2P" for e in events) else "OptimizerStep"


def critical_path(
    traces: dict[int, list[dict]], t0: float, t1: float, target: Sequence[float], end_stage: int = 0
) -> dict[str, Any]:
    """Seconds of [t0, t1] split by `PARTS` along the path that ends on ``end_stage`` at t1 (the walk above).
    ``target``: the configured (forward, backward) seconds of one instruction. Also the path's hops and the
    messages' latencies."""
    peers = match_messages(traces)
    cuts = {s: cut_op(ev) for s, ev in traces.items()}
    parts = dict.fromkeys(PARTS, 0.0)
    hops: list[float] = []
    s, t = end_stage, t1
    events = traces[s]
    i = _last_before(events, t)
    guard = sum(len(e) for e in traces.values()) * 2
    while t > t0 and guard > 0:
        guard -= 1
        if i is None:
            parts["between"] += t - t0
            break
        e = events[i]
        end = min(e["end"], t)
        if end < t:  # a gap between instructions
            parts["cut" if e["op"] == cuts[s] else "between"] += t - max(end, t0)
            t = max(end, t0)
            if t <= t0:
                break
        start = max(e["start"], t0)
        jump: Optional[tuple[int, int, float]] = None
        for ps, pi in peers.get((s, i), []):
            posted = traces[ps][pi]["start"]
            if posted > e["start"] and (jump is None or posted > jump[2]):
                jump = (ps, pi, posted)
        if jump is not None and jump[2] < end:
            lat = end - max(jump[2], t0)
            parts["message"] += lat
            hops.append(lat)
            s, t, events = jump[0], max(jump[2], t0), traces[jump[0]]
            i = _last_before(events, t, inclusive=jump[1])
            continue
        dur = end - start
        if e["op"] in COMPUTE:
            wait = min(dur, target[COMPUTE[e["op"]]])
            parts["wait"] += wait
            parts["overshoot"] += dur - wait
        else:
            parts[_part(e["op"])] += dur
        t = start
        i = i - 1 if i > 0 else None
    return {"parts": parts, "hops": len(hops), "message_s": sorted(hops)}


def _last_before(events: list[dict], t: float, inclusive: Optional[int] = None) -> Optional[int]:
    """Index of the last event that started before ``t`` (``inclusive``: that event itself, where a jump lands
    at a peer's post, which is that event's start)."""
    if inclusive is not None:
        return inclusive
    for i in range(len(events) - 1, -1, -1):
        if events[i]["start"] < t:
            return i
    return None


def per_stage(traces: dict[int, list[dict]], t0: float, t1: float, target: Sequence[float]) -> dict[int, dict]:
    """Per stage, seconds of [t0, t1] by `PARTS` as that stage spent them (``message``: none here; a
    communication instruction's seconds are ``commit``, waiting for the peer included)."""
    out = {}
    for s, events in traces.items():
        parts = dict.fromkeys(PARTS, 0.0)
        inside, cut = 0.0, cut_op(events)
        for e, nxt in zip(events, [*events[1:], None]):
            if nxt is not None and e["op"] == cut:
                parts["cut"] += max(0.0, min(nxt["start"], t1) - max(e["end"], t0))
            a, b = max(e["start"], t0), min(e["end"], t1)
            if b <= a:
                continue
            inside += b - a
            if e["op"] in COMPUTE:
                wait = min(b - a, target[COMPUTE[e["op"]]])
                parts["wait"] += wait
                parts["overshoot"] += b - a - wait
            else:
                parts[_part(e["op"])] += b - a
        parts["between"] = (t1 - t0) - inside - parts["cut"]
        out[s] = parts
    return out


def cut_times(events: list[dict]) -> list[float]:
    """End of each ReduceGrads on a stage: the batch cuts."""
    return [e["end"] for e in events if e["op"] == "ReduceGrads"]
