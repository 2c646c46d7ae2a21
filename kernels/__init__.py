"""Triton kernels (installed as ``shuffleprune.kernels``).

The 2:4 kernel with an in-kernel permuted gather is tracked by the deployable-checkpoint issue;
nothing here is used by the pruning pipeline yet.
"""
