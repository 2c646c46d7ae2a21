"""One-shot pruning as a recipe of stages: :class:`PruneConfig` says what, :func:`prune` walks the blocks."""
from shuffleprune.prune.config import PruneConfig
from shuffleprune.prune.driver import PruneResult, prune, resumable
from shuffleprune.prune.recipes import DEFAULT_RECIPE, PRESETS

__all__ = ["PruneConfig", "PruneResult", "prune", "resumable", "PRESETS", "DEFAULT_RECIPE"]
