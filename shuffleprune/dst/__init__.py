"""Dynamic sparse training from scratch: the run's settings (``config``), the matrices it masks
(``layers``), the masks' structures (``structures``), learned input permutations (``input_perm``),
the sparsifier (``sparsifier``) and the trainer (``train``)."""
from shuffleprune.dst.config import DSTConfig
from shuffleprune.dst.sparsifier import DynamicSparsifier

__all__ = ["DSTConfig", "DynamicSparsifier"]
