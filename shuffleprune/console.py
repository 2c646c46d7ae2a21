"""The consoles the commands print through: text from users and libraries (paths, names, messages)
is printed as it is, with no rich markup ('[x]' was dropped), emoji codes (':abc:' became an emoji)
or highlighting."""
from __future__ import annotations

from rich.console import Console


def plain_console(stderr: bool = False) -> Console:
    """A console on stdout (or ``stderr``) that prints text as it is."""
    return Console(stderr=stderr, markup=False, emoji=False, highlight=False)
