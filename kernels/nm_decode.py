"""The N:M decode kernel (1–64 tokens): ``y = x[..., perm] @ W_pᵀ (+ b)``, bandwidth-bound, on a
weight in the word layout of :mod:`.nm_words`, and its launcher :func:`nm_decode`.

A program owns ``BLOCK_R`` rows and one split of the kept values and reads the step's ``BLOCK_K·M/N``
inputs once, through the index map, for all its rows (:mod:`.decode_loops`). At one and two tokens
each kept value then *selects* its input among its group's ``M`` (:func:`.decode_loops.select_loop`);
from three tokens (4:8: from one) the tile is expanded to dense in registers and multiplied on the
tensor cores (:func:`.decode_loops.dot_loop`). Where the row count is too small to fill the GPU, the
kept values are split (:mod:`.split_k`). :func:`.decode_tiles.decode_plan` picks the loop, tile and
split. The weight's tiles may be copied by the Tensor Memory Accelerator (:func:`tma_descriptors`)
and a map within aligned blocks read as 1-byte offsets (:func:`block_map_offsets`).

All run on the CPU under ``TRITON_INTERPRET=1`` (how CI checks them against float64 references).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a Linux dependency
    triton = None
try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - a Triton before host-side tensor descriptors (3.4)
    TensorDescriptor = None

from shuffleprune.kernels import gpu, overlap, split_k
from shuffleprune.kernels.decode_tiles import DECODE_STAGES, decode_plan
from shuffleprune.kernels.gpu import cdiv
from shuffleprune.kernels.launch import BoundLaunch, fast
from shuffleprune.kernels.nm_words import check_pattern, check_tiled

if triton is not None:
    from shuffleprune.kernels.decode_loops import dot_loop, select_loop
    from shuffleprune.kernels.nm_words import prefetch_positions
    from shuffleprune.kernels.overlap import prefetch_rows, release_next, wait_for_inputs
    from shuffleprune.kernels.split_k import write_output

    @triton.jit
    def _decode_ids(R, T, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr):
        """A decode program's split index, its rows and the tokens (with their in-range masks)."""
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        toks = tl.arange(0, BLOCK_T)
        return tl.program_id(1), rows, rows < R, toks, toks < T


    @triton.jit
    def _store_decode(acc, rows, row_ok, toks, tok_ok, bias_ptr, y_ptr, part_ptr, count_ptr, pid_s, T, R, stride_yt,
                      HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, SUM_HERE: tl.constexpr, BLOCK_R: tl.constexpr,
                      BLOCK_T: tl.constexpr):
        """``acc`` ``[BLOCK_R, BLOCK_T]`` (float32) to ``y`` (+ bias), or to split ``pid_s``'s partial sums
        (:func:`write_output`)."""
        write_output(acc, toks[None, :] * stride_yt + rows[:, None], toks[None, :] * R + rows[:, None],
                     row_ok[:, None] & tok_ok[None, :], rows[:, None], row_ok[:, None], bias_ptr, y_ptr, part_ptr,
                     count_ptr, pid_s, tl.program_id(0) * BLOCK_R, 0, T, R, stride_yt, HAS_BIAS, SPLIT, SUM_HERE,
                     BLOCK_R, BLOCK_T)

    @triton.jit
    def _nm_decode_kernel(x_ptr, val_ptr, word_ptr, perm_ptr, bias_ptr, y_ptr, part_ptr, count_ptr,
                          T, R, K, C, WORDS, stride_xt, stride_yt, K_PER_SPLIT,
                          N: tl.constexpr, M: tl.constexpr, BITS: tl.constexpr,
                          HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                          USE_DOT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                          BLOCK_T: tl.constexpr, STAGES: tl.constexpr, PREC: tl.constexpr = "tf32",
                          UPCAST: tl.constexpr = False, WEIGHT_A: tl.constexpr = False,
                          TILED: tl.constexpr = False, X_WORDS: tl.constexpr = False,
                          SUM_HERE: tl.constexpr = False, NATIVE: tl.constexpr = True,
                          PDL: tl.constexpr = False, PREFETCH: tl.constexpr = 0, LINE: tl.constexpr = 64,
                          PREFETCH_WORDS: tl.constexpr = 0, MAP_SPAN: tl.constexpr = 0, BY_GROUP: tl.constexpr = True,
                          TMA: tl.constexpr = False, SPREAD: tl.constexpr = False):
        """Rows ``program_id(0)``, kept values of split ``program_id(1)``, every token: the select loop
        (:func:`select_loop`: few tokens, no tensor cores, no dense tile) or, with ``USE_DOT``, the
        tensor-core loop (:func:`dot_loop`; ``PREC``, ``UPCAST``, ``WEIGHT_A`` and ``NATIVE`` are its
        own). A map's gather is read as 32-bit words the pipeline copies (``X_WORDS``, see
        :func:`step_inputs`), else a step ahead in registers (:func:`_inputs_ahead`); a map within
        aligned blocks of ``MAP_SPAN`` columns as 1-byte offsets; ``BY_GROUP``: the select loop's own;
        ``TMA``: the tensor-core loop's, ``val_ptr`` and ``word_ptr`` then tensor descriptors; ``SPREAD``: its
        expansion's (:func:`.nm_words.dense_tile`).
        ``PDL``
        (launched as a programmatic dependent, :mod:`.overlap`): the first ``PREFETCH`` kept values of
        each row and their ``PREFETCH_WORDS`` position words go to L2 while the kernel before still
        runs; nothing is read of the input, nor written, before that kernel has ended."""
        pid_s, rows, row_ok, toks, tok_ok = _decode_ids(R, T, BLOCK_R, BLOCK_T)
        k_start = pid_s * K_PER_SPLIT
        k_end = tl.minimum(k_start + K_PER_SPLIT, K)
        if PREFETCH > 0:
            prefetch_rows(val_ptr, rows, row_ok, K, k_start, k_end, PREFETCH, LINE)
        if PREFETCH_WORDS > 0:
            prefetch_positions(word_ptr, rows, row_ok, k_start, k_end, WORDS, BITS, BLOCK_R, PREFETCH_WORDS, TILED)
        wait_for_inputs(PDL)
        release_next(PDL)
        if USE_DOT:
            acc = dot_loop(x_ptr, val_ptr, word_ptr, perm_ptr, rows, row_ok, toks, tok_ok, k_start, k_end, K, C, WORDS,
                           stride_xt, N, M, BITS, HAS_PERM, PREC, UPCAST, BLOCK_R, BLOCK_K, BLOCK_T, STAGES, WEIGHT_A,
                           TILED, X_WORDS, NATIVE, MAP_SPAN, TMA, SPREAD)
        else:
            acc = select_loop(x_ptr, val_ptr, word_ptr, perm_ptr, rows, row_ok, toks, tok_ok, k_start, k_end, K, C,
                              WORDS, stride_xt, N, M, BITS, HAS_PERM, BLOCK_R, BLOCK_K, BLOCK_T, STAGES, TILED, X_WORDS,
                              MAP_SPAN, BY_GROUP)
        _store_decode(acc, rows, row_ok, toks, tok_ok, bias_ptr, y_ptr, part_ptr, count_ptr, pid_s, T, R, stride_yt,
                      HAS_BIAS, SPLIT, SUM_HERE, BLOCK_R, BLOCK_T)


def word_gather(x2: torch.Tensor) -> bool:
    """Whether the decode kernels can read ``x2`` ``[T, C]`` through an index map as 32-bit words
    (``X_WORDS``): 16-bit elements, a 4-byte aligned start and an even row stride."""
    return x2.element_size() == 2 and x2.data_ptr() % 4 == 0 and x2.stride(0) % 2 == 0


def nm_decode(x: torch.Tensor, values: torch.Tensor, words: torch.Tensor, n: int, m: int, bits: int,
              perm: torch.Tensor | None = None, bias: torch.Tensor | None = None, tiled: bool = False,
              async_gather: bool | None = None, sum_in_kernel: bool | None = None, pdl: bool = False,
              block_map: tuple[torch.Tensor, int] | None = None, **plan_overrides) -> torch.Tensor:
    """``x`` ``[..., C]`` with at most :func:`decode_max_tokens` tokens (64; float32: 16) →
    ``x[..., perm] @ W_pᵀ + bias`` ``[..., R]``. ``tiled``: ``words`` ``[R, C/32]`` hold 2:4
    positions in cuSPARSELt's order (:func:`shuffleprune.deploy.cslt_layout.cslt_words`), not row
    by row; the same holds for :func:`nm_gemm` and :func:`nm_decompress_into`. ``async_gather``:
    the select kernel and the weight-as-A tensor-core kernel read the map's gather as 32-bit words
    the pipeline copies ahead (default: wherever :func:`word_gather` allows; the other tensor-core
    kernel would spill with them), ``False`` one step ahead in registers (to 16 tokens).
    ``sum_in_kernel``: split-K's last program of each row tile adds the partial sums (default, see
    :func:`.split_k.split_counters`); ``False``: a second launch does (:func:`.split_k.sum_partials`).
    ``pdl``: launch as a programmatic dependent that prefetches its weight's first part into L2 while
    the kernel before it ends (:mod:`.overlap`; where :func:`.overlap.enabled`, else an ordinary
    launch: the same result either way). ``block_map``: ``perm`` again as ``(offsets, span)``
    (:func:`block_map_offsets`, a map within aligned blocks of ``span`` columns): the kernel reads the
    map as those 1-byte offsets, a quarter of the int32 map's bytes. ``tma=True`` (with ``use_dot`` and
    ``weight_a``): the weight's tiles are copied by the Tensor Memory Accelerator, where
    :func:`tma_applies`."""
    lead, cols = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, cols).contiguous()
    tokens = x2.shape[0]
    rows, kept = values.shape
    if tokens == 0:   # nothing to launch (a tile of no tokens does not compile)
        check_pattern(n, m, bits)
        return x.new_empty(*lead, rows)
    device = x.device
    pdl = pdl and overlap.enabled(x)
    span = block_span(block_map, perm, cols)
    key = (rows, kept, tokens, cols, n, m, bits, x2.dtype, values.dtype, device, gpu.sm_count(device),
           gpu.smem_per_sm(device), tiled, perm is None, bias is None, perm is not None and word_gather(x2),
           async_gather, pdl, span, tuple(plan_overrides.items()))
    launch = _LAUNCHES.get(key)
    if span:
        perm = block_map[0]
    if launch is None or launch.plain.fast_kernel.kernel is not _nm_decode_kernel:   # (a kernel swapped in)
        def first(stages: int) -> tuple[DecodeLaunch, torch.Tensor]:   # the launch at this pipeline depth, run
            fitted = _decode_launch(x2, values, n, m, bits, perm, bias, tiled, async_gather, pdl, span,
                                    {**plan_overrides, "stages": stages})
            return fitted, _run_decode(fitted, x2, values, words, perm, bias, sum_in_kernel, tokens, rows, kept, cols,
                                       device)

        # the plan's depth, or on a GPU with less shared memory than Hopper's the deepest that fits
        launch, y = gpu.with_fewer_stages(first, plan_overrides.get("stages", DECODE_STAGES))[1]
        _LAUNCHES[key] = launch
    else:
        y = _run_decode(launch, x2, values, words, perm, bias, sum_in_kernel, tokens, rows, kept, cols, device)
    return y.reshape(*lead, rows)


def _run_decode(launch: DecodeLaunch, x2: torch.Tensor, values: torch.Tensor, words: torch.Tensor,
                perm: torch.Tensor | None, bias: torch.Tensor | None, sum_in_kernel: bool | None, tokens: int,
                rows: int, kept: int, cols: int, device: torch.device) -> torch.Tensor:
    """One :func:`nm_decode` launch (and split-K's separate sum where the kernel does not add its partial
    sums) of ``x2`` ``[tokens, cols]`` on ``values`` ``[rows, kept]``: ``y`` ``[tokens, rows]``."""
    y = torch.empty(tokens, rows, dtype=x2.dtype, device=device)
    split = launch.split
    part = split_k.partials(split, y)
    counts = split_k.summing(split, launch.grid[0], device, sum_in_kernel)
    dummy, n_words = values, words.shape[1]
    if launch.tma is not None:   # a descriptor holds its tensor: made per call
        values, words = tma_descriptors(x2, values, words, *launch.tma)
    args = (x2, values, words, perm if perm is not None else dummy, bias if bias is not None else dummy, y, part,
            counts if counts is not None else dummy, tokens, rows, kept, cols, n_words, x2.stride(0),
            y.stride(0), launch.per_split)
    (launch.summed if counts is not None else launch.plain)(launch.grid, *args)
    if split > 1 and counts is None:
        y = split_k.sum_partials(part, bias, y)
    return y


class DecodeLaunch(NamedTuple):
    """What a decode launch's shapes, dtypes and options fix (:func:`_decode_launch`): everything but
    the tensors' addresses and split-K's arrival counters, which change from call to call."""

    grid: tuple[int, int]
    split: int
    per_split: int
    plain: BoundLaunch    # the kernel with its keyword arguments (compile-time constants, warps, launch options)
    summed: BoundLaunch   # the same for a split-K launch that adds its partial sums in the kernel
    tma: tuple | None = None   # tma_descriptors' arguments after the tensors: N, M, bits, tiled and the tile


_LAUNCHES: dict[tuple, DecodeLaunch] = {}   # nm_decode's launches by everything that fixes them
DECODE_ARGS = 16   # the decode kernel's positional (runtime) arguments, as nm_decode passes them


def _decode_launch(x2: torch.Tensor, values: torch.Tensor, n: int, m: int, bits: int, perm: torch.Tensor | None,
                   bias: torch.Tensor | None, tiled: bool, async_gather: bool | None, pdl: bool, span: int,
                   plan_overrides: dict) -> DecodeLaunch:
    """:func:`nm_decode`'s plan, grid and keyword arguments for ``x2`` ``[T, C]`` on ``values``, worked
    out once per kind of call and then looked up (:data:`_LAUNCHES`): an eager decode step launches
    several per decoder layer, and the host's work per launch is what a plain ``generate()`` waits
    on (``scripts/bench_host_overhead.py``)."""
    check_pattern(n, m, bits)
    tokens, cols = x2.shape
    rows, kept = values.shape
    p = decode_plan(rows, kept, tokens, n, m, bits, x2.device, element_bytes=x2.element_size(), **plan_overrides)
    check_tiled(tiled, p["block_r"])
    can_words = perm is not None and word_gather(x2) and (not p["use_dot"] or p["weight_a"])
    if async_gather and perm is not None and not can_words:
        raise ValueError("async_gather needs the select kernel or weight_a, and 16-bit inputs at a 4-byte aligned "
                         "address with an even row stride")
    grid = (cdiv(rows, p["block_r"]), p["split"])
    common = dict(N=n, M=m, BITS=bits, HAS_PERM=perm is not None, HAS_BIAS=bias is not None, SPLIT=p["split"],
                  BLOCK_R=p["block_r"], BLOCK_K=p["block_k"], BLOCK_T=p["block_t"], STAGES=p["stages"],
                  TILED=tiled, X_WORDS=can_words and async_gather is not False, num_warps=p["num_warps"],
                  **({"MAP_SPAN": span} if span else {}), **({} if p["by_group"] else {"BY_GROUP": False}))
    if p["tma"]:   # what the descriptors can read is checked where they are made (tma_descriptors)
        common["TMA"] = True
    if p["spread"]:
        common["SPREAD"] = True
    if pdl and not p["tma"]:   # each program prefetches its rows' first kept values of its split, and their positions
        share = overlap.prefetch_per_row(grid[0] * grid[1], p["block_r"], p["per_split"], values.element_size(),
                                         overlap.decode_prefetch_bytes(tokens))
        common.update(PDL=True, LINE=overlap.LINE_BYTES // values.element_size(), PREFETCH=share,
                      PREFETCH_WORDS=overlap.position_words_per_row(share, bits, tiled))
    dot = dict(PREC=gpu.precision(x2), UPCAST=gpu.upcast(x2), WEIGHT_A=p["weight_a"], NATIVE=gpu.native(x2))
    plain = dict(USE_DOT=p["use_dot"], **(dot if p["use_dot"] else {}), **common, SUM_HERE=False,
                 **overlap.launch_options(pdl))
    kernel = fast(_nm_decode_kernel)
    return DecodeLaunch(grid, p["split"], p["per_split"], kernel.bind(DECODE_ARGS, plain),
                        kernel.bind(DECODE_ARGS, {**plain, "SUM_HERE": True}),
                        (n, m, bits, tiled, p["block_r"], p["block_k"]) if p["tma"] else None)


def tma_applies(x: torch.Tensor, values: torch.Tensor, words: torch.Tensor, n: int, m: int, tiled: bool) -> bool:
    """Whether :func:`nm_decode` may read this weight by tensor descriptors (``tma=True``): 2:4 values of
    ``x``'s 16-bit dtype and (in the export's layout; cuSPARSELt's order is read as without) the int32
    position words, each contiguous at a 16-byte aligned address with rows a multiple of 16 bytes (the
    Tensor Memory Accelerator's terms), on a device that has one (:func:`.gpu.tma`) and a Triton with
    tensor descriptors."""
    described = (values,) if tiled else (values, words)
    return (TensorDescriptor is not None and (n, m) == (2, 4) and gpu.tma(x) and values.dtype == x.dtype
            and values.element_size() == 2 and (tiled or words.dtype == torch.int32)
            and all(t.is_contiguous() and t.data_ptr() % 16 == 0 and t.shape[1] * t.element_size() % 16 == 0
                    for t in described))


def tma_descriptors(x2: torch.Tensor, values: torch.Tensor, words: torch.Tensor, n: int, m: int, bits: int,
                    tiled: bool, block_r: int, block_k: int) -> tuple:
    """The ``TMA`` weight arguments of a decode of ``x2``: a tensor descriptor of the 16-bit 2:4 value pairs
    as int32 ``[R, K/2]`` in blocks ``[block_r, block_k/2]``, and one of the position words in blocks
    ``[block_r, block_k·bits/32]`` (``tiled``: the words as they are). Made per call: a descriptor holds
    its tensor. Refuses what :func:`tma_applies` refuses, and steps of under 16 bytes of words per row."""
    if not tma_applies(x2, values, words, n, m, tiled) or block_k * bits < 128:
        raise ValueError("tma needs 2:4 values of the inputs' 16-bit dtype and int32 position words, contiguous, "
                         "16-byte aligned, rows a multiple of 16 bytes, at least 64 kept values per step, on "
                         "sm_90 or later")
    pairs = TensorDescriptor.from_tensor(values.view(torch.int32), [block_r, block_k // 2])
    return pairs, words if tiled else TensorDescriptor.from_tensor(words, [block_r, block_k * bits // 32])


MAX_BLOCK_SPAN = 256   # the widest block whose offsets fit one byte


def block_map_offsets(perm: torch.Tensor, span: int) -> torch.Tensor:
    """An index map within aligned blocks of ``span`` columns (``perm[c] // span == c // span``, as
    :func:`shuffleprune.deploy.input_gather.map_span` finds; the last block may be cut short) as each
    column's offset within its block, one byte each (``uint8 [C]``): what the decode kernels read
    instead of the int32 map."""
    if not 0 < span <= MAX_BLOCK_SPAN or span & (span - 1):
        raise ValueError(f"a block map's span is a power of two up to {MAX_BLOCK_SPAN}, not {span}")
    base = torch.arange(perm.numel(), device=perm.device) // span * span
    offsets = perm.long() - base
    if bool(((offsets < 0) | (offsets >= span)).any()):
        raise ValueError(f"this map leaves its blocks of {span} columns: use its map_span")
    return offsets.to(torch.uint8)


def block_span(block_map: tuple[torch.Tensor, int] | None, perm: torch.Tensor | None, cols: int) -> int:
    """The span :func:`nm_decode` reads ``block_map`` with: its own where there is a map and the offsets
    cover the input's ``cols`` columns, a multiple of 4, from a 4-byte aligned address (the kernels
    read them as 32-bit words); else 0 (the int32 map is read)."""
    if block_map is None or perm is None or block_map[0].numel() != cols or cols % 4 or \
            block_map[0].data_ptr() % 4:   # read as 32-bit words
        return 0
    return block_map[1]
