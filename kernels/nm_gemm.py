"""The N:M prefill kernels on a weight in the word layout of :mod:`.nm_words`.

- :func:`nm_gemm` (from 17 tokens): a tiled GEMM ``y = x_p @ W_pᵀ`` over already-permuted inputs whose
  weight tiles are decompressed in registers for ``tl.dot``; its tile and split-K come from a cost
  model (:func:`gemm_plan`) over tiles compiled for sm_90a; ``weight_a`` puts the weight in the MMA's
  A operand, ``tall`` gives each program 128 weight rows (two warpgroups) for each input tile it reads.
- :func:`nm_decompress_into`: the dense ``W_p`` written into a caller's buffer (the shared scratch a
  dense matmul reads; no layer keeps a dense copy).
- :func:`nm_decompress_mapped_into`: the dense weight in the input's *original* order,
  ``W[:, c] = W_p[:, inv[c]]``, written into such a buffer: a dense matmul then reads the layer's
  input as it is, with no gathered copy of it (on a prompt that copy is a full read and write of the
  activation: 2048 × 14336 took 199 µs with ``index_select`` on an H100). Each program expands whole
  rows group by group and reorders them in shared memory (``tl.gather``), rows up to
  :data:`MAPPED_MAX_BYTES` wide.

Both run on the CPU under ``TRITON_INTERPRET=1``.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a Linux dependency
    triton = None

from shuffleprune.kernels import gpu, overlap, split_k
from shuffleprune.kernels.gpu import cdiv, next_pow2
from shuffleprune.kernels.launch import fast
from shuffleprune.kernels.nm_words import check_pattern, check_tiled

if triton is not None:
    from shuffleprune.kernels.nm_words import dense_tile, mma_step, prefetch_positions
    from shuffleprune.kernels.overlap import prefetch_rows, release_next, wait_for_inputs
    from shuffleprune.kernels.split_k import write_output

    @triton.jit
    def _nm_gemm_kernel(x_ptr, val_ptr, word_ptr, bias_ptr, y_ptr, part_ptr, count_ptr, T, R, C, K, WORDS, stride_xt, stride_yt,
                        C_PER_SPLIT, N: tl.constexpr, M: tl.constexpr, BITS: tl.constexpr, HAS_BIAS: tl.constexpr,
                        SPLIT: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr, BLOCK_T: tl.constexpr,
                        BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, GROUP_T: tl.constexpr,
                        WEIGHT_A: tl.constexpr = False, TILED: tl.constexpr = False, SUM_HERE: tl.constexpr = False,
                        NATIVE: tl.constexpr = True, PDL: tl.constexpr = False, PREFETCH: tl.constexpr = 0,
                        LINE: tl.constexpr = 64, PREFETCH_WORDS: tl.constexpr = 0):
        """Token tile × row tile ``program_id(0)`` (in grouped order), dense columns of split
        ``program_id(1)``. ``PDL`` (a programmatic dependent, :mod:`.overlap`): the programs of the first
        token tile prefetch the first ``PREFETCH`` kept values of their rows in their split and their
        ``PREFETCH_WORDS`` position words into L2 while the kernel before still runs; nothing is read of
        the input, nor written, before that kernel has ended."""
        BLOCK_K: tl.constexpr = BLOCK_C * N // M
        pid, pid_s = tl.program_id(0), tl.program_id(1)
        n_t, n_r = tl.cdiv(T, BLOCK_T), tl.cdiv(R, BLOCK_R)
        per_group = GROUP_T * n_r                      # grouped order: neighbouring programs share weight tiles in L2
        first_t = (pid // per_group) * GROUP_T
        size_t = tl.minimum(n_t - first_t, GROUP_T)
        pid_t = first_t + (pid % per_group) % size_t
        pid_r = (pid % per_group) // size_t
        toks = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
        rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        tok_ok, row_ok = toks < T, rows < R
        if WEIGHT_A:
            acc = tl.zeros((BLOCK_R, BLOCK_T), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
        c_start = pid_s * C_PER_SPLIT
        if PREFETCH > 0:   # once per row tile: by the first token tile's programs
            lead = row_ok & (pid_t == 0)
            k_lo, k_hi = c_start * N // M, tl.minimum(c_start + C_PER_SPLIT, C) * N // M
            prefetch_rows(val_ptr, rows, lead, K, k_lo, k_hi, PREFETCH, LINE)
            if PREFETCH_WORDS > 0:
                prefetch_positions(word_ptr, rows, lead, k_lo, k_hi, WORDS, BITS, BLOCK_R, PREFETCH_WORDS, TILED)
        wait_for_inputs(PDL)
        release_next(PDL)
        for c0 in range(c_start, tl.minimum(c_start + C_PER_SPLIT, C), BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            xs = tl.load(x_ptr + toks[:, None] * stride_xt + cols[None, :], mask=tok_ok[:, None] & (cols < C)[None, :],
                         other=0.0)
            dense = dense_tile(val_ptr, word_ptr, rows, row_ok, c0 * N // M, K, WORDS, N, M, BITS, BLOCK_R, BLOCK_K,
                               "", TILED, NATIVE)
            acc = mma_step(acc, dense, xs, WEIGHT_A, UPCAST, PREC)
        if WEIGHT_A:
            acc = tl.trans(acc)
        write_output(acc, toks[:, None] * stride_yt + rows[None, :], toks[:, None] * R + rows[None, :],
                     tok_ok[:, None] & row_ok[None, :], rows[None, :], row_ok[None, :], bias_ptr, y_ptr, part_ptr,
                     count_ptr, pid_s, pid_r * BLOCK_R, pid_t * BLOCK_T, T, R, stride_yt, HAS_BIAS, SPLIT, SUM_HERE,
                     BLOCK_R, BLOCK_T)

    @triton.jit
    def _nm_decompress_kernel(val_ptr, word_ptr, out_ptr, R, C, K, WORDS,
                              N: tl.constexpr, M: tl.constexpr, BITS: tl.constexpr,
                              BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, TILED: tl.constexpr = False,
                              NATIVE: tl.constexpr = True):
        G: tl.constexpr = BLOCK_K // N
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = rows < R
        k0 = tl.program_id(1) * BLOCK_K
        dense = dense_tile(val_ptr, word_ptr, rows, row_ok, k0, K, WORDS, N, M, BITS, BLOCK_R, BLOCK_K,
                           "evict_first", TILED, NATIVE)
        cols = (k0 // N) * M + tl.arange(0, G * M)
        tl.store(out_ptr + rows[:, None] * C + cols[None, :], dense, mask=row_ok[:, None] & (cols < C)[None, :])

    @triton.jit
    def _nm_decompress_mapped_kernel(val_ptr, word_ptr, inv_ptr, out_ptr, R, C, K, WORDS, rows,
                                     N: tl.constexpr, M: tl.constexpr, BITS: tl.constexpr, CP: tl.constexpr):
        """Weight rows ``program_id(0)·rows …`` (fewer at the end), each whole: every group of ``W_p``'s row
        (``CP / M`` of them, ``CP`` ≥ ``C``) puts each of its ``N`` kept values at its position among its
        ``M`` columns (zeros elsewhere), the row is put in the input's order through shared memory
        (``out[r, c] = W_p[r, inv[c]]``) and stored whole. (Expanded per column instead, each column
        loading its group's words and values, the sm_90a loop took 704 instructions per 16384-column
        row; per group, 519.)"""
        F: tl.constexpr = 32 // BITS
        G: tl.constexpr = CP // M
        cols = tl.arange(0, CP)
        ok = cols < C
        inv = tl.load(inv_ptr + cols, mask=ok, other=0)
        groups = tl.arange(0, G)
        slots = tl.arange(0, M)
        first = tl.program_id(0).to(tl.int64) * rows
        for step in range(rows):
            r = first + step
            live = cols < tl.where(r < R, C, 0)
            g_ok = groups < tl.where(r < R, K // N, 0)
            dense = tl.zeros((G, M), dtype=val_ptr.dtype.element_ty)
            for k in tl.static_range(N):
                i = groups * N + k                      # each group's k-th kept value
                word = tl.load(word_ptr + r * WORDS + i // F, mask=g_ok, other=0)
                pos = (word >> ((i % F) * BITS)) & ((1 << BITS) - 1)
                value = tl.load(val_ptr + r * K + i, mask=g_ok, other=0.0, eviction_policy="evict_first")
                dense = tl.where(pos[:, None] == slots[None, :], value[:, None], dense)
            dense = tl.reshape(dense, (CP,))
            tl.store(out_ptr + r * C + cols, tl.gather(dense, inv, 0), mask=live)


# prefill tiles (block_t, block_r, block_c, warps, stages), each with its loop's instructions per warp
# per step and the programs an SM holds, from its bfloat16 compile for sm_90a at 2048 tokens
# (scripts/check_kernels_compile.py; tests/test_kernels.py checks they still hold), per N:M (other
# N:M are costed as 2:4). The weight tile is expanded in registers and stored for the tensor cores,
# then the tensor-core call is waited on within the step: one program's expansion overlaps only
# with another program's tensor-core work.
GEMM_TILES = {
    (2, 4): (((256, 64, 32, 8, 3), 130, 2), ((128, 64, 32, 4, 4), 165, 4),
             ((64, 64, 32, 4, 4), 149, 7), ((32, 64, 64, 4, 3), 299, 4)),
    (4, 8): (((256, 64, 32, 8, 3), 165, 2), ((128, 64, 32, 4, 4), 288, 4),
             ((64, 64, 32, 4, 4), 271, 6), ((32, 64, 64, 4, 3), 532, 4)),
}
# the GEMM with the weight as the MMA's A operand (``weight_a``): rows in M (64 per warpgroup), tokens in
# N (up to 256 per wgmma), the expanded tile fed from registers to an asynchronous wgmma that stays in
# flight while the next tile expands (the tiles above wait for theirs within the step: the weight is
# their B operand, stored to shared memory first). Compiled for sm_90a like GEMM_TILES; not yet timed.
GEMM_TILES_SWAP = {
    (2, 4): (((256, 64, 64, 4, 3), 335, 2), ((256, 64, 32, 8, 3), 145, 2),
             ((128, 64, 32, 4, 4), 178, 4), ((64, 64, 64, 4, 4), 245, 4)),
    (4, 8): (((256, 64, 64, 4, 3), 657, 2), ((256, 64, 32, 8, 3), 194, 2),
             ((128, 64, 32, 4, 4), 301, 4), ((64, 64, 64, 4, 4), 575, 4)),
}
# the weight-as-A GEMM over 128 weight rows per program (two warpgroups of 64 rows, 8 warps): each input
# tile it reads from L2 serves twice the rows. On an H100 the 64-row tiles of 2048 tokens ran at the rate
# L2 hands out their operands (input and weight tiles, every step of every program: 4096×4096 201.5 µs,
# 6.0 TB/s; 11008×4096 554 µs, 5.9; 4096×11008 503 µs, 6.5; ``tune_swap_gemm.json``), 2.5–2.7× the time
# :func:`gemm_cycles` expects of their tensor and issue work. These tiles read 0.56× (256 tokens) and
# 0.68× (128) the 256 × 64 tile's operand bytes per FLOP. Compiled for sm_90a as GEMM_TILES (no spill;
# 4:8's 128 × 128 tile holds one program per SM); not yet timed. ``auto`` times them as ``gemm_swap_tall``.
GEMM_TILES_SWAP_TALL = {
    (2, 4): (((256, 128, 64, 8, 3), 269, 1), ((128, 128, 64, 8, 3), 257, 2), ((64, 128, 64, 8, 4), 231, 2)),
    (4, 8): (((256, 128, 64, 8, 3), 588, 1), ((128, 128, 64, 8, 3), 564, 1), ((64, 128, 64, 8, 4), 548, 2)),
}
GEMM_TILE_FP32 = (32, 64, 32, 4, 3)  # float32: full-precision FMA, no tensor cores; larger tiles spill
TENSOR_FLOP_PER_CYCLE = 4096          # dense 16-bit tensor-core FLOP per SM per clock (H100: 989 TFLOP/s)
L2_BYTES_PER_CYCLE = 24               # per SM: about 5.5 TB/s of H100 L2, where split-K's partial sums stay


def gemm_cycles(tokens: int, rows: int, cols: int, tile: tuple[int, int, int, int, int], loop: int, per_sm: int,
                sms: int, split: int = 1, overlap: bool = False) -> float:
    """Clocks the busiest SM spends on :func:`nm_gemm` with ``tile`` and ``split`` column splits:
    every step a program issues ``loop`` instructions per warp (4 issued per clock) and then waits
    for its tensor-core work; the programs resident together overlap one's issue with another's
    tensor work. ``overlap``: each program's tensor-core call stays in flight while it expands its next
    tile (the weight-as-A tiles), so a program's step takes the longer of the two, not their sum.
    Split-K adds its float32 partial sums, written and read back through L2."""
    block_t, block_r, block_c, warps, _ = tile
    issue = loop * warps / 4
    tensor = 2 * block_t * block_r * block_c / TENSOR_FLOP_PER_CYCLE
    programs = cdiv(tokens, block_t) * cdiv(rows, block_r) * split
    on_sm = cdiv(programs, sms)
    batches = [per_sm] * (on_sm // per_sm) + ([on_sm % per_sm] if on_sm % per_sm else [])
    if overlap:
        step = sum(b * max(issue, tensor) for b in batches)
    else:
        step = sum(max(issue + tensor, b * issue, b * tensor) for b in batches)
    reduce = 0 if split == 1 else (2 * split * 4 + 2) * tokens * rows / (sms * L2_BYTES_PER_CYCLE)
    return cdiv(cdiv(cols, block_c), split) * step + reduce


def operand_bytes(tokens: int, rows: int, cols: int, tile: tuple[int, int, int, int, int], split: int = 1,
                  n: int = 2, m: int = 4, bits: int = 2, element_bytes: int = 2) -> float:
    """Bytes :func:`nm_gemm`'s programs read from L2 with ``tile``: every step of every program its
    ``block_t × block_c`` input tile and its ``block_r × block_c`` N:M weight tile (values and position
    bits). :func:`gemm_cycles` does not count them; at 2048 tokens on an H100 the 64-row weight-as-A tiles
    ran at 5.9–6.5 TB/s of them (:data:`GEMM_TILES_SWAP_TALL`)."""
    block_t, block_r, block_c = tile[:3]
    programs = cdiv(tokens, block_t) * cdiv(rows, block_r) * split
    steps = cdiv(cdiv(cols, block_c), split)
    per_step = block_c * (block_t * element_bytes + block_r * n / m * element_bytes + block_r * bits / m / 8)
    return programs * steps * per_step


def gemm_tiles(weight_a: bool = False, tall: bool = False) -> dict:
    """The tile table :func:`plan_gemm` chooses from: :data:`GEMM_TILES`, with ``weight_a``
    :data:`GEMM_TILES_SWAP`, with ``tall`` as well :data:`GEMM_TILES_SWAP_TALL`."""
    if not weight_a:
        return GEMM_TILES
    return GEMM_TILES_SWAP_TALL if tall else GEMM_TILES_SWAP


_PLANS: dict[tuple, tuple] = {}   # gemm_plan's answers by its arguments and the device's SM count


def gemm_plan(tokens: int, rows: int, cols: int, n: int, m: int, bits: int, device: torch.device,
              element_bytes: int = 2, weight_a: bool = False,
              tall: bool = False) -> tuple[tuple[int, int, int, int, int], int]:
    """:func:`plan_gemm`, costed once per token count, shape, pattern, options and SM count and then
    looked up: the host runs it at every GEMM launch, and costing every tile and split took 0.26–0.53
    ms on a 2-core CPU (``scripts/results/bench_host_overhead.json``), several times an H100's time for
    a 512-token 4096×4096 layer."""
    key = (tokens, rows, cols, n, m, bits, element_bytes, weight_a, tall, gpu.sm_count(device))
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = plan_gemm(tokens, rows, cols, n, m, bits, device, element_bytes, weight_a, tall)
    return plan


def plan_gemm(tokens: int, rows: int, cols: int, n: int, m: int, bits: int, device: torch.device,
              element_bytes: int = 2, weight_a: bool = False,
              tall: bool = False) -> tuple[tuple[int, int, int, int, int], int]:
    """``((block_t, block_r, block_c, num_warps, num_stages), split)`` of :func:`nm_gemm`: of the
    tiles of :func:`gemm_tiles` (with ``weight_a`` costed with the tensor-core call overlapping the next
    expansion) of N:M whose steps hold whole position
    words, and of 1, 2, 4 or 8 column splits, the pair :func:`gemm_cycles` finds fastest on this device's SMs. Large
    token tiles expand each weight tile once for more tokens; smaller tiles and split-K give every
    SM programs when tokens or rows are few."""
    min_c = 32 // bits * m // n          # dense columns per step that hold one whole position word
    if element_bytes >= 4:
        block_t, block_r, block_c, warps, stages = GEMM_TILE_FP32
        return (block_t, block_r, max(block_c, min_c), warps, stages), 1
    table = gemm_tiles(weight_a, tall)
    tiles = [t for t in table.get((n, m), table[(2, 4)]) if t[0][2] % min_c == 0]
    if not tiles:                        # sparse position words (1:16): the smallest tile, wider
        return (32, 64, min_c, 4, 3), 1
    sms = gpu.sm_count(device)
    options = [(t, s) for t in tiles for s in (1, 2, 4, 8) if s == 1 or cdiv(cols, t[0][2]) >= 4 * s]
    (tile, _, _), split = min(options, key=lambda o: (gemm_cycles(tokens, rows, cols, *o[0], sms, o[1], weight_a), o[1]))
    return tile, split


def nm_gemm(x: torch.Tensor, values: torch.Tensor, words: torch.Tensor, n: int, m: int, bits: int,
            bias: torch.Tensor | None = None, tile: tuple[int, int, int, int, int] | None = None,
            split: int | None = None, weight_a: bool = False, tiled: bool = False,
            sum_in_kernel: bool | None = None, pdl: bool = False, tall: bool = False) -> torch.Tensor:
    """``x`` ``[..., C]`` already in the weight's (permuted) column order → ``x @ W_pᵀ + bias``
    (``tile`` and ``split`` default to :func:`gemm_plan`'s; a given ``tile`` alone runs unsplit).
    ``weight_a``: the weight tile is the MMA's A operand (``acc[rows, tokens]``), see
    :data:`GEMM_TILES_SWAP`; ``tall`` (with ``weight_a``): planned over :data:`GEMM_TILES_SWAP_TALL`.
    ``sum_in_kernel``: as in :func:`nm_decode`. ``pdl``: launch as a
    programmatic dependent that prefetches its weight's first part into L2 while the kernel before it
    ends (as :func:`nm_decode`'s ``pdl``; an ordinary launch where :func:`.overlap.enabled` is false)."""
    check_pattern(n, m, bits)
    lead, cols = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, cols).contiguous()
    tokens = x2.shape[0]
    rows, kept = values.shape
    if tile is None:
        tile, planned = gemm_plan(tokens, rows, cols, n, m, bits, x.device, x.element_size(), weight_a, tall)
        split = split or planned
    block_t, block_r, block_c, warps, stages = tile
    if (block_c * n // m) % (32 // bits):
        raise ValueError(f"block_c {block_c} must hold whole position words for {n}:{m}")
    check_tiled(tiled, block_r)
    per_split = cdiv(cdiv(cols, block_c), split or 1) * block_c
    split = cdiv(cols, per_split)
    y = torch.empty(tokens, rows, dtype=x.dtype, device=x.device)
    part = split_k.partials(split, y)
    grid = (cdiv(tokens, block_t) * cdiv(rows, block_r), split)
    counts = split_k.summing(split, grid[0], x.device, sum_in_kernel)
    dependent = {}
    if pdl and overlap.enabled(x):   # each row tile's first kept values of each split, and their positions
        share = overlap.prefetch_per_row(cdiv(rows, block_r) * split, block_r, per_split * n // m,
                                         values.element_size())
        dependent = dict(PDL=True, LINE=overlap.LINE_BYTES // values.element_size(), PREFETCH=share,
                         PREFETCH_WORDS=overlap.position_words_per_row(share, bits, tiled),
                         **overlap.launch_options(True))

    def launch(stages: int) -> None:
        fast(_nm_gemm_kernel)[grid](x2, values, words, bias if bias is not None else values, y, part,
                              counts if counts is not None else values, tokens, rows, cols, kept,
                              words.shape[1], x2.stride(0), y.stride(0), per_split, N=n, M=m, BITS=bits,
                              HAS_BIAS=bias is not None, SPLIT=split, PREC=gpu.precision(x), UPCAST=gpu.upcast(x),
                              BLOCK_T=block_t, BLOCK_R=block_r, BLOCK_C=block_c, GROUP_T=8, WEIGHT_A=weight_a,
                              TILED=tiled, SUM_HERE=counts is not None, NATIVE=gpu.native(x), num_warps=warps,
                              num_stages=stages, **dependent)

    # the tile's pipeline depth, or on a GPU with less shared memory than Hopper's the deepest that fits
    gpu.with_fewer_stages(launch, stages, ("nm_gemm", tile, weight_a, tiled, n, m, x.dtype, values.dtype, x.device,
                                           bool(dependent)))
    if split > 1 and counts is None:
        y = split_k.sum_partials(part, bias, y)
    return y.reshape(*lead, rows)


MAPPED_MAX_BYTES = 32 * 1024     # nm_decompress_mapped_into's widest row (padded to a power of two), staged in
                                 # shared memory: 16384 16-bit columns, 8192 float32 ones (compiled for sm_90a,
                                 # 32768 16-bit columns spilled 216 bytes; 16384 none)


def mapped_fits(cols: int, n: int, m: int, dtype: torch.dtype) -> bool:
    """Whether :func:`nm_decompress_mapped_into` takes rows of ``cols`` columns of ``dtype`` (N and M
    powers of two, the row padded to a power of two within :data:`MAPPED_MAX_BYTES`)."""
    return triton is not None and not (n & (n - 1) or m & (m - 1)) and \
        next_pow2(cols) * dtype.itemsize <= MAPPED_MAX_BYTES


def nm_decompress_mapped_into(values: torch.Tensor, words: torch.Tensor, n: int, m: int, bits: int, cols: int,
                              inverse: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Write the dense ``[R, cols]`` weight in the input's original order, ``W_p[:, inverse]`` (``inverse``:
    int32 ``[cols]``, the index map's inverse), into ``out`` (at least ``R·cols`` elements of the values'
    dtype); returns that view. A dense matmul of the *un*-gathered input with it is the mapped layer."""
    from shuffleprune.kernels.gather import rows_per_program

    check_pattern(n, m, bits)
    if not mapped_fits(cols, n, m, values.dtype):
        raise ValueError(f"the mapped decompress stages at most {MAPPED_MAX_BYTES} bytes per row; {cols} columns "
                         f"of {values.dtype} do not fit: decompress in the permuted order and gather the input")
    if inverse.shape != (cols,):
        raise ValueError(f"inverse map {tuple(inverse.shape)} must be ({cols},)")
    rows, kept = values.shape
    dense = out.reshape(-1)[: rows * cols].view(rows, cols)
    if rows:
        width = next_pow2(cols)
        per_program = rows_per_program(rows, gpu.sm_count(values.device))
        fast(_nm_decompress_mapped_kernel)[(cdiv(rows, per_program),)](
            values, words, inverse, dense, rows, cols, kept, words.shape[1], per_program, N=n, M=m, BITS=bits,
            CP=width, num_warps=max(4, min(16, width // 512)))
    return dense


def nm_decompress_into(values: torch.Tensor, words: torch.Tensor, n: int, m: int, bits: int, cols: int,
                       out: torch.Tensor, block_r: int = 16, block_k: int = 64, num_warps: int = 4,
                       tiled: bool = False) -> torch.Tensor:
    """Write the dense ``[R, cols]`` ``W_p`` into ``out`` (a buffer of at least ``R·cols`` elements of
    the values' dtype); returns the ``[R, cols]`` view. ``block_k`` kept values per program row."""
    check_pattern(n, m, bits)
    rows, kept = values.shape
    dense = out.reshape(-1)[: rows * cols].view(rows, cols)
    block_k = max(32 // bits, block_k)
    check_tiled(tiled, block_r)
    grid = (cdiv(rows, block_r), cdiv(kept, block_k))
    fast(_nm_decompress_kernel)[grid](values, words, dense, rows, cols, kept, words.shape[1], N=n, M=m, BITS=bits,
                                BLOCK_R=block_r, BLOCK_K=block_k, TILED=tiled, NATIVE=gpu.native(values),
                                num_warps=num_warps)
    return dense
