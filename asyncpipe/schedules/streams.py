"""Every stage's instruction stream by schedule name (drawing, the ideal timelines, bench, the cost model): a declared
schedule's own, or one of the streams drawn beside them that no config runs."""

from __future__ import annotations

from asyncpipe.errors import UserError
from asyncpipe.schedules import Stream, get, schedules
from asyncpipe.schedules.gpipe import gpipe_stream
from asyncpipe.schedules.instructions import Instruction, flatten
from asyncpipe.schedules.twobw import two_bw_deferred_stream


def drawn_only() -> dict[str, Stream]:
    """Streams no config runs, drawn beside the declared ones: 2BW with deferred steps, GPipe."""
    return {"2bw-deferred": two_bw_deferred_stream, "gpipe": gpipe_stream}


def streamed(kind: str = "") -> list[str]:
    """Names `stream` knows: every declared schedule with a stream of its own, and the drawn-only ones; ``kind``,
    an import path (``pkg.module``), is imported first so its schedule is among them."""
    if "." in kind:
        get(kind)
    return [s.name for s in schedules() if s.stream or s.ideal] + list(drawn_only())


def stream(kind: str, micro_batches: int, stages: int, stage_id: int, batches: int = 1) -> list[Instruction]:
    """A stage's flat instruction stream by schedule name: a declared schedule's (``2bw``, ``paci``, ``1f1b`` as
    DeepSpeed's, a registered one), ``2bw-deferred`` or ``gpipe``."""
    maker = drawn_only().get(kind)
    if maker is not None:
        return maker(micro_batches, stages, stage_id, batches)
    if kind not in streamed(kind) and get(kind).name not in streamed():
        raise UserError(f"unknown schedule {kind!r}; choose one of: {', '.join(streamed())}")
    spec = get(kind)
    return flatten((spec.ideal or spec.stream)(micro_batches, stages, stage_id, batches, 0, False))
