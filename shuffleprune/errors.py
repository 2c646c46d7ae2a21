"""The one exception type that the CLI turns into a one-line message and a non-zero exit."""


class UserError(Exception):
    """Bad input or an unavailable resource; the message names the fix."""
