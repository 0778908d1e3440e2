"""The one exception type for mistakes a user can make; the CLI prints it as one line and exits 2."""


class UserError(Exception):
    """A problem with the user's input (config, data, paths): message says what is wrong and what is allowed."""


# Exit codes of `asyncpipe train` (the sweep launchers read them).
EXIT_USER_ERROR = 2  # a UserError: nothing ran
EXIT_DIVERGED = 3  # NaN/inf loss or one above train.diverge_loss
EXIT_INTERRUPTED = 4  # a signal arrived; a checkpoint was written and resume=true continues
