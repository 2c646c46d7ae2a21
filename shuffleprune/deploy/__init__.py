"""Deployable N:M checkpoints: the compressed format (``format``), the runtime layer
(``sparse_linear``; the implementations it can run in ``impls``, how ``auto`` picks one in
``auto_choice``, its answers kept between processes in ``choice_store``; Triton kernels in ``shuffleprune.kernels``), ``export`` and ``load``."""
