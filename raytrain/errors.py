"""The one exception type for mistakes a user can fix.

A ``UserError`` carries a single line that says what is wrong and what to do instead. The CLI prints it
without a traceback and exits with status 2; anything else that escapes is a bug and keeps its traceback.
"""


class UserError(Exception):
    """A problem with the user's input or environment, phrased as what is wrong and how to fix it."""

    exit_code = 2

    def __init__(self, message: str) -> None:
        if "\n" in message:
            raise ValueError("UserError messages must be one line")
        super().__init__(message)
