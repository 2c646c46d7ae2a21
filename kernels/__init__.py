"""Triton kernels (installed as ``shuffleprune.kernels``), all checked on the CPU under ``TRITON_INTERPRET=1``.

The word-layout N:M kernels ``SparseLinear`` runs on CUDA: ``nm_words`` (the layout, read and
expanded to dense tiles in registers), ``nm_decode`` (1–64 tokens: the select and tensor-core decode
loops and their plan), ``nm_resident`` (2:4 at 1–2 tokens, each program's inputs read once through
the map and rows streamed past them), ``nm_gemm`` (prefill GEMM and decompression into the shared scratch),
``split_k`` (column splits' partial sums, added in the same launch), ``gpu`` (the device facts the
host code plans with). ``nm_experts``: every expert of a fused MoE projection in one launch (the
decode loops per block of pairs routed to one expert). ``nm_matmul``: the first gather / group
kernels, kept as candidates. ``norm_map``: an RMSNorm that writes its output through an index map
(producer-side maps). ``overlap``: programmatic dependent launch (a decode starting, and prefetching
its weight, while the kernel before it ends); ``gather``: an index map's gather that lets the decode
after it start early. ``launch``: launches that skip Triton's per-call dispatch once a kind of call
was seen (the eager host's cost per kernel). ``compile_check``: compile them for sm_90a without a GPU and read the result.
"""

if __name__ == "kernels":
    # Imported by the top-level name: the repository root is on sys.path (``python -m pytest`` or a REPL started
    # there), and this folder shadows Hugging Face's ``kernels`` package, which transformers ≥ 5.25 installs and
    # imports with every model. Load that package in place of this folder where it is installed; where it is not,
    # this folder stays what ``kernels`` names (transformers then sees no version and no hub kernels).
    import importlib.util as _util
    import os as _os
    import sys as _sys
    from importlib.machinery import PathFinder as _PathFinder

    _root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    _spec = _PathFinder.find_spec(__name__, [entry for entry in _sys.path
                                             if _os.path.abspath(entry or _os.curdir) != _root])
    if _spec is not None and _spec.loader is not None:
        _hub = _util.module_from_spec(_spec)
        _sys.modules[__name__] = _hub   # what the import statement returns once this file has run
        _spec.loader.exec_module(_hub)
