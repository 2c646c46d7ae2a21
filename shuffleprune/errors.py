"""The one exception type that the CLI turns into a one-line message and a non-zero exit."""
from __future__ import annotations

import os
from pathlib import Path


class UserError(Exception):
    """Bad input or an unavailable resource; the message names the fix."""


def reason(exc: BaseException, limit: int = 200) -> str:
    """What ``exc`` says, on one line (whitespace collapsed; its type's name when it says nothing),
    at most ``limit`` characters: the cause quoted inside a :class:`UserError`."""
    return (" ".join(str(exc).split()) or type(exc).__name__)[:limit]


def check_values(*rules: tuple[str, object, bool, str]) -> None:
    """Refuse the first of ``(name, value, ok, what it must be)`` whose ``ok`` is false, in one line naming
    the option, what it must be and what it was given: ``--steps must be >= 1, got 0``."""
    for name, value, ok, must in rules:
        if not ok:
            raise UserError(f"{name} must be {must}, got {value}")


def given_path(value: str | os.PathLike | None, name: str) -> Path | None:
    """``value`` as a :class:`Path` (None stays None); an empty string refused: ``Path("")`` is the current
    directory, so an unset shell variable (``--out "$OUT"``) would read, write or clear there."""
    if value is None:
        return None
    if not str(value).strip():   # (a Path is never empty: Path("") is ".")
        raise UserError(f"{name} is empty (an unset shell variable?); give a path, or '.' for this directory")
    return Path(value)
