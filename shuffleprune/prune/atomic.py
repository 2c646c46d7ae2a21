"""Files a resumed run can trust: written to a temporary name, then renamed into place."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

import torch


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """``write`` to a temporary file, then rename it onto ``path``: a reader finds it whole or not at all."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def atomic_save(obj: Any, path: Path) -> None:
    atomic_write(path, lambda tmp: torch.save(obj, tmp))


def atomic_json(obj: Any, path: Path) -> None:
    atomic_write(path, lambda tmp: tmp.write_text(json.dumps(obj, indent=2)))
