"""The statuses a run can end in (`summary.json`'s "status"), the sweep states built on them, and their exit codes.

One home for these names: the run lifecycle writes them, the launchers and the report read them.
"""

from __future__ import annotations

from asyncpipe.errors import EXIT_DIVERGED, EXIT_INTERRUPTED

COMPLETED = "completed"  # every step ran
DIVERGED = "diverged"  # a NaN/inf loss or one above train.diverge_loss ended it (exit 3)
INTERRUPTED = "interrupted"  # a stop signal ended it after a checkpoint; resume=true continues (exit 4)
FAILED = "failed"  # an error ended it (a traceback, a dead rank)

# Sweep-side states of a run that has not ended (yet).
PENDING, QUEUED, RUNNING = "pending", "queued", "running"

EXIT_CODES = {COMPLETED: 0, DIVERGED: EXIT_DIVERGED, INTERRUPTED: EXIT_INTERRUPTED, FAILED: 1}


def exit_code(status: str) -> int:
    """The process exit code of a run that ended in ``status``."""
    return EXIT_CODES[status]
