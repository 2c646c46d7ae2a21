"""Dynamic sparse training from scratch: the sparsifier (``sparsifier``) and the trainer (``train``)."""
from shuffleprune.dst.sparsifier import DSTConfig, DynamicSparsifier

__all__ = ["DSTConfig", "DynamicSparsifier"]
