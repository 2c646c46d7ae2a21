"""Files a resumed run can trust: written to a temporary name, then renamed into place."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from shuffleprune.outdir import atomic_write

__all__ = ["atomic_write", "atomic_save", "atomic_json"]


def atomic_save(obj: Any, path: Path) -> None:
    atomic_write(path, lambda tmp: torch.save(obj, tmp))


def atomic_json(obj: Any, path: Path) -> None:
    atomic_write(path, lambda tmp: tmp.write_text(json.dumps(obj, indent=2)))
