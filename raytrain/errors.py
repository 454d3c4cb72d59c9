"""The exception types that carry a message for the user.

A ``UserError`` carries a single line that says what is wrong and what to do instead. The CLI prints it
without a traceback and exits with status 2; anything else that escapes is a bug and keeps its traceback.
``Fatal`` is raised inside a training function for an error no retry can fix.
"""


class UserError(Exception):
    """A problem with the user's input or environment, phrased as what is wrong and how to fix it."""

    exit_code = 2

    def __init__(self, message: str) -> None:
        if "\n" in message:
            raise ValueError("UserError messages must be one line")
        super().__init__(message)


class Fatal(Exception):
    """Raised in a training function: an error that no retry can fix (a diverged loss, data that cannot be
    read), so the run fails at once instead of restarting its workers up to ``--max-failures`` times. Its
    message becomes the run's error: say what is wrong and what to do."""
