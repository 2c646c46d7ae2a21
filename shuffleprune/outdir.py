"""Output directories that a run clears: never one that holds the run's own inputs."""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

from shuffleprune.errors import UserError


def refuse_clearing_inputs(out: Path, inputs: Iterable[str | Path | None], flag: str = "--out") -> None:
    """Refuse to clear ``out`` when it is, or lies above, an existing local input (a model dir, a
    text file, earlier index maps): ``--overwrite`` would delete that input before it is read, or
    replace it with the result. Names that are no local path (hub ids, ``wiki``) are skipped."""
    target = Path(out).expanduser().resolve()
    for item in inputs:
        if item is None or str(item) == "":
            continue
        path = Path(item).expanduser()
        if not path.exists():
            continue
        source = path.resolve()
        if source == target or target in source.parents:
            what = "is" if source == target else "holds"
            raise UserError(f"{flag} '{out}' {what} the input '{item}': clearing it would delete that input; "
                            f"give another {flag}")
