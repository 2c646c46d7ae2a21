"""Triton kernels (installed as ``shuffleprune.kernels``), all checked on the CPU under ``TRITON_INTERPRET=1``.

``nm_fast``: the word-layout N:M kernels ``SparseLinear`` runs on CUDA (decode, prefill GEMM,
decompression into the shared scratch). ``nm_experts``: every expert of a fused MoE projection in
one launch (the decode loops of ``nm_fast`` per block of pairs routed to one expert). ``nm_matmul``:
the first gather / group kernels, kept as candidates. ``norm_map``: an RMSNorm that writes its output through an index map (producer-side maps).
"""
