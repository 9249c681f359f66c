"""Errors caused by user input: the CLI prints them as one line (no traceback), the server as HTTP 400."""


class UserError(ValueError):
    """Bad input from the user, with a message naming the file, field or value at fault."""
