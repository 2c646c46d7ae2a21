"""Triton kernel: ``y = x[..., perm] @ W_pᵀ (+ b)`` with ``W_p`` stored compressed N:M.

The kernel reads the compressed values ``[R, K]`` (``K = C·N/M``) and the packed in-group positions
(see ``shuffleprune.sparse_format``), reconstructs the column of each kept value in permuted order
(``(k // N)·M + pos``), maps it through the index map (``perm[col]``, the *gather at permuted
addresses*, done on the load of ``x`` — no separate gather launch, no permuted copy of ``x``), and
accumulates in float32. One program computes ``BLOCK_R`` output rows for ``BLOCK_T`` tokens; it is
meant for the memory-bound decode regime (few tokens), where reading ``K`` values plus ``K·b/8``
metadata bytes instead of ``C`` dense values is the whole speed-up.

Runs on the CPU under ``TRITON_INTERPRET=1`` (how CI checks it against a float64 reference).
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a Linux dependency
    triton = None

from shuffleprune.kernels.gpu import cdiv, next_pow2


def available() -> bool:
    """Whether the Triton kernel can run here (a CUDA device, or the interpreter)."""
    import os

    return triton is not None and (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")


if triton is not None:
    @triton.jit
    def _nm_gather_matmul(x_ptr, val_ptr, meta_ptr, perm_ptr, bias_ptr, y_ptr,
                          T, R, K, META_W, stride_xt, stride_yt,
                          N: tl.constexpr, M: tl.constexpr, BITS: tl.constexpr,
                          HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr,
                          BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr):
        PER: tl.constexpr = 8 // BITS
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        toks = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
        row_ok = rows < R
        tok_ok = toks < T
        acc = tl.zeros((BLOCK_R, BLOCK_T), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            ok = row_ok[:, None] & (ks < K)[None, :]
            v = tl.load(val_ptr + rows[:, None] * K + ks[None, :], mask=ok, other=0.0).to(tl.float32)
            byte = tl.load(meta_ptr + rows[:, None] * META_W + (ks // PER)[None, :], mask=ok, other=0).to(tl.int32)
            pos = (byte >> ((ks % PER) * BITS)[None, :]) & ((1 << BITS) - 1)
            col = (ks // N)[None, :] * M + pos
            if HAS_PERM:
                col = tl.load(perm_ptr + col, mask=ok, other=0)
            xg = tl.load(x_ptr + toks[None, None, :] * stride_xt + col[:, :, None],
                         mask=ok[:, :, None] & tok_ok[None, None, :], other=0.0).to(tl.float32)
            acc += tl.sum(v[:, :, None] * xg, axis=1)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
        tl.store(y_ptr + toks[None, :] * stride_yt + rows[:, None], acc.to(y_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & tok_ok[None, :])


if triton is not None:
    @triton.jit
    def _nm_group_matmul(x_ptr, val_ptr, meta_ptr, perm_ptr, bias_ptr, y_ptr,
                         T, R, K, C, META_W, stride_xt, stride_yt,
                         N: tl.constexpr, M: tl.constexpr, BITS: tl.constexpr,
                         HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr, USE_DOT: tl.constexpr,
                         BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr):
        """N and M powers of two. Per step: ``BLOCK_K`` kept values of ``BLOCK_R`` rows are expanded
        in registers into their ``BLOCK_K·M/N`` dense columns (permuted order); the matching inputs
        are gathered once per program (shared by all its rows) and multiplied — with ``tl.dot``
        (tensor cores) when the tile allows it."""
        PER: tl.constexpr = 8 // BITS
        G: tl.constexpr = BLOCK_K // N
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        toks = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
        row_ok = rows < R
        tok_ok = toks < T
        slot = tl.arange(0, M)
        acc = tl.zeros((BLOCK_R, BLOCK_T), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            ok = row_ok[:, None] & (ks < K)[None, :]
            v = tl.load(val_ptr + rows[:, None] * K + ks[None, :], mask=ok, other=0.0)
            byte = tl.load(meta_ptr + rows[:, None] * META_W + (ks // PER)[None, :], mask=ok, other=0).to(tl.int32)
            pos = (byte >> ((ks % PER) * BITS)[None, :]) & ((1 << BITS) - 1)
            # dense[r, g, j] = value of row r whose in-group position is j (0 where pruned)
            hit = tl.reshape(pos, (BLOCK_R, G, N))[:, :, :, None] == slot[None, None, None, :]
            vals = tl.reshape(v, (BLOCK_R, G, N))[:, :, :, None]
            dense = tl.reshape(tl.sum(tl.where(hit, vals, tl.zeros_like(vals)), axis=2), (BLOCK_R, G * M))
            cols = (k0 // N) * M + tl.arange(0, G * M)
            col_ok = cols < C
            src = tl.load(perm_ptr + cols, mask=col_ok, other=0) if HAS_PERM else cols
            xs = tl.load(x_ptr + toks[None, :] * stride_xt + src[:, None],
                         mask=col_ok[:, None] & tok_ok[None, :], other=0.0)              # [G·M, T]
            if USE_DOT:
                acc = tl.dot(dense.to(xs.dtype), xs, acc)
            else:
                acc += tl.sum(dense.to(tl.float32)[:, :, None] * xs.to(tl.float32)[None, :, :], axis=1)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
        tl.store(y_ptr + toks[None, :] * stride_yt + rows[:, None], acc.to(y_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & tok_ok[None, :])


def _pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


def default_tile(tokens: int, variant: str = "gather") -> tuple[int, int, int]:
    """``(block_r, block_k, num_warps)`` for a token count and kernel variant. ``gather``: the tiles
    fastest across the LLaMA-2-7B linear shapes in ``scripts/tune_kernel.py``'s sweep on an H100
    (``scripts/results/tune_kernel.json``): few rows per program and long steps along the values."""
    if variant == "group":  # best of its sweep (tune_kernel_group.json)
        return (8, 512, 4) if tokens == 1 else (16, 128, 4)
    return (4, 512, 4) if tokens == 1 else (8, 64, 2)


def nm_gather_matmul(x: torch.Tensor, values: torch.Tensor, meta: torch.Tensor, n: int, m: int, bits: int,
                     perm: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                     block_r: int | None = None, block_k: int | None = None,
                     num_warps: int | None = None, variant: str | None = None) -> torch.Tensor:
    """``x`` ``[..., C]`` → ``[..., R]``: ``x[..., perm] @ decompress(values, meta)ᵀ + bias``.

    ``variant``: ``gather`` (default: every kept value gathers its own input) or ``group`` (N and M
    powers of two: each step's values are expanded to dense columns in registers and the inputs
    gathered once per program, with tensor-core ``tl.dot`` from 16 rows × 16 tokens). On an H100
    ``group`` was 1.8–2× slower than ``gather`` at one token and 1.1–1.7× faster from 16 tokens up,
    still far slower than dense there (``scripts/results/bench_kernel.json``).

    ``block_r`` / ``block_k`` / ``num_warps``: tile of output rows, of kept values per loop step, and
    warps per program; by default :func:`default_tile`."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    variant = variant or "gather"
    if variant not in ("gather", "group") or (variant == "group" and not (_pow2(n) and _pow2(m))):
        raise ValueError(f"kernel variant {variant!r} is not available for {n}:{m}")
    lead, cols = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, cols).contiguous()
    tokens = x2.shape[0]
    rows, kept = values.shape
    y = torch.empty(tokens, rows, dtype=x.dtype, device=x.device)
    block_t = max(1, min(16, next_pow2(tokens)))
    tile = default_tile(tokens, variant)
    block_r, block_k, num_warps = block_r or tile[0], block_k or tile[1], num_warps or tile[2]
    grid = (cdiv(rows, block_r), cdiv(tokens, block_t))
    dummy = values  # any tensor: unused pointer when HAS_PERM / HAS_BIAS is off
    common = dict(N=n, M=m, BITS=bits, HAS_PERM=perm is not None, HAS_BIAS=bias is not None,
                  BLOCK_R=block_r, BLOCK_K=block_k, BLOCK_T=block_t, num_warps=num_warps)
    args = (x2, values, meta, perm if perm is not None else dummy, bias if bias is not None else dummy, y)
    if variant == "group":
        use_dot = block_r >= 16 and block_t >= 16 and block_k * m // n >= 16
        _nm_group_matmul[grid](*args, tokens, rows, kept, cols, meta.shape[1], x2.stride(0), y.stride(0),
                               USE_DOT=use_dot, **common)
    else:
        _nm_gather_matmul[grid](*args, tokens, rows, kept, meta.shape[1], x2.stride(0), y.stride(0), **common)
    return y.reshape(*lead, rows)
