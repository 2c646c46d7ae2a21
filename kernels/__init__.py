"""Triton kernels (installed as ``shuffleprune.kernels``).

``nm_matmul.nm_gather_matmul``: ``y = x[..., perm] @ W_pᵀ`` from compressed N:M values + packed
positions, gathering ``x`` at permuted addresses inside the kernel. Used by
``shuffleprune.sparse_linear.SparseLinear`` on CUDA for small token counts; checked on the CPU under
``TRITON_INTERPRET=1``.
"""
