"""The one exception type that the CLI turns into a one-line message and a non-zero exit."""


class UserError(Exception):
    """Bad input or an unavailable resource; the message names the fix."""


def reason(exc: BaseException, limit: int = 200) -> str:
    """What ``exc`` says, on one line (whitespace collapsed; its type's name when it says nothing),
    at most ``limit`` characters: the cause quoted inside a :class:`UserError`."""
    return (" ".join(str(exc).split()) or type(exc).__name__)[:limit]
