"""Where each implementation of a :class:`~shuffleprune.deploy.sparse_linear.SparseLinear` applies, and
the candidates ``auto`` weighs for a layer and an input (:func:`candidates`, in the order it times them).

Each rule reads a layer's pattern, layout, index map and values and an input's token count, dtype and
device; none changes the layer. :meth:`SparseLinear.run <shuffleprune.deploy.sparse_linear.SparseLinear.run>`
launches what :func:`runs_as` says: the implementation named where it applies, else its nearest that does.
The implementations' names and kernel options are :mod:`.impls`'.
"""
from __future__ import annotations

import torch
from torch import nn

from shuffleprune.deploy.impls import (GATHER_MAX_TOKENS, GEMM_MIN_TOKENS, MAPPED_MAX_TOKENS, NOT_WEIGHED,
                                       SPARSE_GEMM, SPARSE_GEMM_MIN_TOKENS, SPARSE_MMA_DECODES, SPARSE_WGMMA,
                                       SPARSE_WGMMA_MAPPED, SWAP_TILES, TILE_MAX_TOKENS, skipped_impls)


def tokens_of(x: torch.Tensor) -> int:
    """The tokens in ``x`` (every dimension but the last)."""
    return x.numel() // x.shape[-1]


def pow2(layer: nn.Module) -> bool:
    """Whether the layer's N and M are powers of two (the Triton kernels' patterns)."""
    return not (layer.n & (layer.n - 1) or layer.m & (layer.m - 1))


def offsets_apply(layer: nn.Module) -> bool:
    """Whether the map fits ``decode_offsets``: within aligned blocks of at most 256 columns (as ``prune``
    writes them), its width a multiple of 4."""
    from shuffleprune.kernels.nm_decode import MAX_BLOCK_SPAN

    span = layer.map_span
    return span is not None and span <= MAX_BLOCK_SPAN and layer.in_features % 4 == 0


def maps_into_scratch(layer: nn.Module) -> bool:
    """Whether ``scratch_mapped`` applies: a mapped layer in the export's layout (not cuSPARSELt's), N and M
    powers of two, rows narrow enough for the kernel's shared memory."""
    from shuffleprune.kernels.nm_gemm import mapped_fits

    return layer.perm is not None and not layer.tiled and mapped_fits(layer.in_features, layer.n, layer.m,
                                                                      layer.values.dtype)


def tma_applies(layer: nn.Module, x: torch.Tensor, resident: bool = False) -> bool:
    """Whether ``decode_swap_tma`` (``resident``: ``decode_resident_tma``) can read the layer's weight for
    ``x`` by tensor descriptors (:func:`.nm_decode.tma_applies`; the resident decode's chunks hold at
    least 64 kept values where the layer has them)."""
    from shuffleprune.kernels.nm_decode import tma_applies as descriptors_read

    return descriptors_read(x, layer.values, layer.words(), layer.n, layer.m, layer.tiled) and \
        (not resident or layer.values.shape[1] >= 64)


def sparse_mma_applies(layer: nn.Module, x: torch.Tensor, mapped: bool = False) -> bool:
    """Whether ``decode_sparse_mma`` (``mapped``: reading the map itself) runs the layer on ``x``: 2:4 values
    of the input's 16-bit dtype, 1–64 tokens (1–16 mapped), whole steps of 128 columns, on a GPU with sparse
    tensor cores (:mod:`.nm_sparse_mma`)."""
    from shuffleprune.kernels.sparse_mma_tiles import sparse_mma_applies as shape_fits
    from shuffleprune.kernels.nm_sparse_mma import sparse_mma_available

    return (x.dtype == layer.values.dtype and
            shape_fits(tokens_of(x), layer.out_features, layer.in_features, layer.n, layer.m, x.dtype, mapped) and
            sparse_mma_available(x.device))


def sparse_gemm_applies(layer: nn.Module, x: torch.Tensor, wgmma: bool = False) -> bool:
    """Whether ``gemm_sparse_mma`` (``wgmma``: ``gemm_sparse_wgmma``) runs the layer on ``x``: 2:4 values of the
    input's 16-bit dtype, rows and columns in 64s, on a GPU with sparse tensor cores (``wgmma``: Hopper;
    :mod:`.nm_sparse_gemm`)."""
    from shuffleprune.kernels.sparse_gemm_tiles import sparse_gemm_applies as shape_fits
    from shuffleprune.kernels.nm_sparse_gemm import sparse_gemm_available, sparse_wgmma_available

    available = sparse_wgmma_available if wgmma else sparse_gemm_available
    return (x.dtype == layer.values.dtype and
            shape_fits(tokens_of(x), layer.out_features, layer.in_features, layer.n, layer.m, x.dtype) and
            available(x.device))


def wgmma_reads_map(layer: nn.Module, x: torch.Tensor) -> bool:
    """Whether ``gemm_sparse_wgmma_mapped`` runs the layer on ``x``: a mapped layer the wgmma form takes, up to
    :data:`.sparse_gemm_tiles.WGMMA_MAPPED_MAX_TOKENS` tokens."""
    from shuffleprune.kernels.sparse_gemm_tiles import WGMMA_MAPPED_MAX_TOKENS

    return (layer.perm is not None and tokens_of(x) <= WGMMA_MAPPED_MAX_TOKENS and
            sparse_gemm_applies(layer, x, wgmma=True))


def sparse_mma_tall_worth(layer: nn.Module, x: torch.Tensor, mapped: bool = False) -> bool:
    """Whether ``auto`` also weighs the sparse-MMA decode with :func:`.sparse_mma_tiles.tall_plan`'s CTAs on ``x``
    (:func:`.sparse_mma_tiles.tall_worth_weighing`: where the input read per 16 rows weighs against the weight)."""
    from shuffleprune.kernels.gpu import sm_count
    from shuffleprune.kernels.sparse_mma_tiles import tall_worth_weighing

    return tall_worth_weighing(tokens_of(x), layer.out_features, layer.in_features, sm_count(x.device), mapped)


def candidates(layer: nn.Module, x: torch.Tensor) -> list[str]:
    """The implementations ``auto`` weighs for ``layer`` on ``x`` (its token count, dtype and device), in
    the order it times them."""
    from shuffleprune.kernels.gpu import kernels_build
    from shuffleprune.kernels.decode_tiles import SELECT_LIMIT_TOKENS, SELECT_MAX_TOKENS, decode_max_tokens, selects
    from shuffleprune.kernels.nm_resident import resident_applies

    if not kernels_build():
        return ["scratch"]
    tokens = tokens_of(x)
    decode_limit = decode_max_tokens(x.element_size())
    out = []
    if pow2(layer):  # from 17 to 64 tokens both Triton kernels are timed
        if tokens <= decode_limit:
            out.append("decode")
        if tokens <= SELECT_MAX_TOKENS:   # the select loop: its pipeline's depth timed both ways
            out.append("decode_shallow")
        # the select loop's other tiles, where the plan takes the select loop: 16-bit inputs (as swept)
        select = selects(tokens, layer.n, layer.m) and x.element_size() == 2
        out += [impl for impl in ("decode_tall", "decode_wide") if select and tokens <= TILE_MAX_TOKENS[impl]]
        if layer.perm is not None and tokens <= min(decode_limit, MAPPED_MAX_TOKENS):
            out.append("decode_mapped")
            out += [impl for impl in ("decode_mapped_tall", "decode_mapped_wide")
                    if select and tokens <= TILE_MAX_TOKENS[impl]]
            if select and (layer.n, layer.m) == (2, 4) and tokens <= TILE_MAX_TOKENS["decode_mapped_by_value"]:
                out.append("decode_mapped_by_value")
            if offsets_apply(layer):
                out.append("decode_offsets")
        if select and resident_applies(tokens, layer.n, layer.m, layer.values):   # with a map or without
            out.append("decode_resident")
            if tma_applies(layer, x, resident=True):
                out.append("decode_resident_tma")
        if SELECT_MAX_TOKENS < tokens <= SELECT_LIMIT_TOKENS:   # below, decode is the select kernel already
            out.append("decode_select")
        if 2 <= tokens <= decode_limit:
            out.append("decode_swap")
        if (layer.n, layer.m) == (2, 4) and x.element_size() == 2:   # as swept and compiled: 2:4, 16-bit inputs
            out += [impl for impl in SWAP_TILES if 2 <= tokens <= TILE_MAX_TOKENS[impl]]
        if 2 <= tokens <= TILE_MAX_TOKENS["decode_swap_tma"] and tma_applies(layer, x):
            out.append("decode_swap_tma")
        if sparse_mma_applies(layer, x):
            out.append("decode_sparse_mma")
            out += ["decode_sparse_mma_tall"] if sparse_mma_tall_worth(layer, x) else []
            if layer.perm is not None and sparse_mma_applies(layer, x, mapped=True):
                out += ["decode_sparse_mma_mapped", "decode_sparse_mma_mapped_inline"]
                out += ["decode_sparse_mma_mapped_tall"] if sparse_mma_tall_worth(layer, x, mapped=True) else []
        if tokens >= SPARSE_GEMM_MIN_TOKENS and sparse_gemm_applies(layer, x):
            out.append(SPARSE_GEMM)
        if sparse_gemm_applies(layer, x, wgmma=True):   # from one token: up to 64 it runs as a decode
            out.append(SPARSE_WGMMA)
            out += [SPARSE_WGMMA_MAPPED] if wgmma_reads_map(layer, x) else []
        out += ["gemm", "gemm_swap"] if tokens >= GEMM_MIN_TOKENS else []
        if tokens >= GEMM_MIN_TOKENS and x.element_size() == 2:   # float32 runs the one FMA tile either way
            out.append("gemm_swap_tall")
    if layer.tiled and x.is_cuda:   # cuSPARSELt on the layer's own buffer; at 1-16 tokens too (padded to 8 or 16
        out.append("cslt")          # tokens: reading its 2:4 weight is the cost there, not the MMAs)
    out.append("scratch")
    if maps_into_scratch(layer) and tokens >= GEMM_MIN_TOKENS:
        out.append("scratch_mapped")
    # the first kernel, only where the decodes do not apply: in every GPU table committed (H100 and H200,
    # over a thousand of auto's choices, those at 1-16 tokens among them) it was never picked, at
    # 0.54-0.70x cuBLAS at one token where the decodes ran 1.2-1.4x (bench_kernel.json, 2026-11-28)
    if tokens <= GATHER_MAX_TOKENS and not layer.tiled and not pow2(layer):
        out.append("gather")
    left_out = skipped_impls()
    return [impl for impl in out if impl not in NOT_WEIGHED and impl not in left_out]


def sparse_mma_maps(layer: nn.Module, impl: str) -> bool:
    """Whether sparse-MMA decode ``impl`` reads the layer's map itself (a ``decode_sparse_mma_mapped*`` one, on a
    mapped layer) rather than the gathered input."""
    return impl.startswith("decode_sparse_mma_mapped") and layer.perm is not None


def runs_as(layer: nn.Module, impl: str, x: torch.Tensor) -> str:
    """The implementation :meth:`SparseLinear.run` launches when ``impl`` (one of ``IMPLS``, without ``+pdl``) is
    asked for on ``x``: ``impl`` where it applies, else its nearest that does, as each step says."""
    if impl in ("decode_resident", "decode_resident_tma"):   # reads the map itself, once per program
        from shuffleprune.kernels.nm_resident import resident_applies

        if resident_applies(tokens_of(x), layer.n, layer.m, layer.values):
            tma = impl == "decode_resident_tma" and tma_applies(layer, x, resident=True)
            return "decode_resident_tma" if tma else "decode_resident"
        impl = "decode_mapped"   # more tokens, another pattern or 32-bit values: the decode reading the map
    if impl in SPARSE_MMA_DECODES:
        if sparse_mma_applies(layer, x, sparse_mma_maps(layer, impl)):
            return impl
        # another pattern, dtype, device or shape: the Triton decode where it runs, else the shared scratch
        impl = "decode" if pow2(layer) and tokens_of(x) <= 64 and x.is_cuda else "scratch"
    if impl == SPARSE_WGMMA_MAPPED:
        if wgmma_reads_map(layer, x):
            return impl
        impl = SPARSE_WGMMA   # no map, more tokens or not Hopper: on the gathered input (or its fallbacks)
    if impl == SPARSE_WGMMA and not sparse_gemm_applies(layer, x, wgmma=True):
        impl = SPARSE_GEMM   # not Hopper: the same GEMM on mma.sp where it runs
    if impl in (SPARSE_GEMM, SPARSE_WGMMA):
        if sparse_gemm_applies(layer, x):
            return impl
        # another pattern, dtype, device or shape: the Triton GEMM where it runs, else the shared scratch
        impl = "gemm_swap" if pow2(layer) and x.is_cuda else "scratch"
    if impl == "decode_swap_tma" and not tma_applies(layer, x):
        impl = "decode_swap"   # a weight or input the tensor descriptors cannot read
    return impl
