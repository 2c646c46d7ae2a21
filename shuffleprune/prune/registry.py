"""Finds the stages recipes may name: every module of :mod:`shuffleprune.prune.stages` registers its
stage classes with :func:`shuffleprune.prune.stage.register` when imported."""
from __future__ import annotations

import importlib
import pkgutil

from shuffleprune.errors import UserError
from shuffleprune.prune import stages
from shuffleprune.prune.stage import KINDS, REGISTRY, Stage


def kind_of(entry: dict) -> str:
    """The stage kind a recipe entry ``{kind: name, param: value, …}`` names."""
    return next(k for k in entry if k in KINDS)


def stage_from_entry(entry: dict) -> Stage:
    """The stage instance of a recipe entry (its parameters; defaults for those it leaves out)."""
    kind = kind_of(entry)
    return stage_class(kind, entry[kind])(**{k: v for k, v in entry.items() if k != kind})


def _load_stages() -> None:
    for info in pkgutil.iter_modules(stages.__path__):
        importlib.import_module(f"{stages.__name__}.{info.name}")


def stage_names(kind: str) -> list[str]:
    """The registered stage names of ``kind``."""
    _load_stages()
    return sorted(name for k, name in REGISTRY if k == kind)


def stage_class(kind: str, name: str) -> type[Stage]:
    """The stage class a recipe entry ``{kind: name}`` names (a one-line error for unknown ones)."""
    _load_stages()
    if kind not in KINDS:
        raise UserError(f"unknown stage kind '{kind}'; use one of {', '.join(KINDS)}")
    if (kind, name) not in REGISTRY:
        raise UserError(f"unknown {kind} stage '{name}'; use one of {', '.join(stage_names(kind))}")
    return REGISTRY[(kind, name)]
