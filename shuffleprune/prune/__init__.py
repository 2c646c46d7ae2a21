"""One-shot pruning as a recipe of stages: :class:`PruneConfig` says what, :func:`prune` walks the blocks.

This package is also the Python API's ``shuffleprune.prune(model, recipe, out, **options)``: calling it
calls :func:`~shuffleprune.prune.api.prune_model`. (Importing a subpackage binds it to the parent's
attribute of its name, so a top-level function named ``prune`` would be replaced by this package on
first import; the package takes the call instead, and ``shuffleprune.prune`` is one object.)"""
import sys
from inspect import Parameter, signature
from types import ModuleType

from shuffleprune.prune.api import prune_model
from shuffleprune.prune.config import PruneConfig
from shuffleprune.prune.driver import PruneResult, prune
from shuffleprune.prune.recipes import DEFAULT_RECIPE, PRESETS
from shuffleprune.prune.run_dir import resumable

__all__ = ["PruneConfig", "PruneResult", "prune", "prune_model", "resumable", "PRESETS", "DEFAULT_RECIPE"]


class _CallablePackage(ModuleType):
    def __call__(self, *args, **kwargs) -> PruneResult:
        return prune_model(*args, **kwargs)

    __call__.__doc__ = prune_model.__doc__


_api = signature(prune_model)  # what inspect and IDEs show for the call (self is dropped from it)
_CallablePackage.__call__.__signature__ = _api.replace(
    parameters=[Parameter("self", Parameter.POSITIONAL_ONLY), *_api.parameters.values()])
sys.modules[__name__].__class__ = _CallablePackage
