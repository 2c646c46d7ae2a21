"""Output directories that a run clears: never one that holds the run's own inputs; a link to one
(an output dir on another disk) stays a link."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterable

from shuffleprune.errors import UserError, reason


def holds(directory: str | Path, path: str | Path) -> bool:
    """Whether ``path`` is ``directory`` or lies inside it (neither needs to exist yet)."""
    top, inner = Path(directory).expanduser().resolve(), Path(path).expanduser().resolve()
    return inner == top or top in inner.parents


def check_writable(directory: Path, flag: str, target: Path | None = None) -> None:
    """Refuse an output directory (the one ``target``, a file, goes in) that is a file or cannot be
    created or written in, before a run rather than after it: a file is made and removed in
    ``directory``, or in its nearest existing parent."""
    if target is None and Path(directory).exists() and not Path(directory).is_dir():
        raise UserError(f"{flag} '{directory}' is a file, not a directory; give a directory path")
    place = Path(directory).expanduser().absolute()
    while not place.exists() and place != place.parent:
        place = place.parent
    try:
        if not place.is_dir():
            raise NotADirectoryError(f"'{place}' is a file")
        handle, name = tempfile.mkstemp(dir=place, prefix=".shuffleprune-write-check-")
        os.close(handle)
        os.unlink(name)
    except OSError as exc:
        raise UserError(f"{flag} '{target or directory}': cannot write in '{place}' "
                        f"({exc.strerror or reason(exc, 80)}); give a writable path") from None


def refuse_clearing_inputs(out: Path, inputs: Iterable[str | Path | None]) -> None:
    """Refuse to clear ``out`` when it is, or lies above, an existing local input (a model dir, a
    text file, earlier index maps): ``--overwrite`` would delete that input before it is read, or
    replace it with the result. Names that are no local path (hub ids, ``wiki``) are skipped."""
    for item in inputs:
        if item is None or str(item) == "" or not Path(item).expanduser().exists():
            continue
        if holds(out, item):
            what = "is" if holds(item, out) else "holds"
            raise UserError(f"--out '{out}' {what} the input '{item}': clearing it would delete that input; "
                            "give another --out")


def clear_dir(path: Path) -> None:
    """Empty ``path`` for a fresh run: a directory is removed; a symlink to one keeps its link and loses
    the contents of the directory it points to."""
    if path.is_symlink():
        for child in path.iterdir():
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()
    elif path.exists():
        shutil.rmtree(path)
