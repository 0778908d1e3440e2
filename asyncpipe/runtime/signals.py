"""Turn stop signals (SIGTERM, Ctrl-C's SIGINT, a closed terminal or ssh session's SIGHUP, SLURM's SIGUSR1/SIGUSR2
warnings) into a flag the run's trainer checks between steps.

The trainer finishes the step in flight, writes a checkpoint, and exits 4: a requeued job (or resume=true) then
resumes exactly there.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Optional

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


class StopRequest:
    """Context manager: while active, SIGTERM / SIGINT / SIGHUP / SIGUSR1 / SIGUSR2 set `requested` instead of
    killing the process."""

    def __init__(self) -> None:
        self.signal_name: Optional[str] = None
        self._previous: dict = {}

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        self.signal_name = signal.Signals(signum).name

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
