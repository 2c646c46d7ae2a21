"""Type checks of the settings a Python caller passes (as a recipe file's are checked): what does not
fit a dataclass field's annotation is named in one line, not a TypeError deep in the run."""
from __future__ import annotations

import reprlib
import types
import typing


def _short(value: typing.Any) -> str:
    """``repr(value)`` cut short (a list of documents must not fill the terminal)."""
    r = reprlib.Repr()
    r.maxstring, r.maxother, r.maxlist, r.maxdict = 60, 60, 3, 3
    return r.repr(value)


def type_problem(cls: type, key: str, value: typing.Any) -> str | None:
    """Why ``value`` does not fit the type of ``cls``'s field ``key`` (None when it does): bools are
    no numbers, an int is a float, a list holds strings."""
    hint = typing.get_type_hints(cls)[key]
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    allowed_types = typing.get_args(hint) if union else (hint,)
    if value is None:
        return None if type(None) in allowed_types else f"'{key}' must not be empty"
    origin = [typing.get_origin(t) or t for t in allowed_types]
    named = " or ".join(t.__name__ for t in origin if t is not type(None))
    if bool in origin:
        return None if isinstance(value, bool) else f"'{key}' must be true or false, got {_short(value)}"
    if isinstance(value, bool):
        return f"'{key}' must be {named}, got {_short(value)}"
    if float in origin and isinstance(value, (int, float)):
        return None
    if list in origin:
        ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
        return None if ok else f"'{key}' must be a list of strings, got {_short(value)}"
    if not any(isinstance(value, t) for t in origin if t is not type(None)):
        return f"'{key}' must be {named}, got {_short(value)}"
    return None
