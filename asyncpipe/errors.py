"""The exception types for mistakes a user can make, and the exit codes of `asyncpipe train`.

The CLI prints a `UserError` as one line and exits 2. Run statuses live in `asyncpipe.status`.
"""


class UserError(Exception):
    """A problem with the user's input (config, data, paths): message says what is wrong and what is allowed."""


class ConfigError(UserError):
    """A config the user composed is invalid."""


# Exit codes of `asyncpipe train` (the sweep launchers read them).
EXIT_USER_ERROR = 2  # a UserError: nothing ran
EXIT_DIVERGED = 3  # NaN/inf loss or one above train.diverge_loss
EXIT_INTERRUPTED = 4  # a signal arrived; a checkpoint was written and resume=true continues
