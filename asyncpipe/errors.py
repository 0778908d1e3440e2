"""The one exception type for mistakes a user can make; the CLI prints it as one line and exits 2."""


class UserError(Exception):
    """A problem with the user's input (config, data, paths): message says what is wrong and what is allowed."""
