"""Deployable N:M checkpoints: the compressed format (``format``), the runtime layer
(``sparse_linear``; Triton kernels in ``shuffleprune.kernels``), ``export`` and ``load``."""
