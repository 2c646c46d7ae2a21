"""The N:M decode's tiles and plans: which loop (select or tensor cores), tile, warps, split-K and
pipeline depth :func:`.nm_decode.nm_decode` launches for a shape and token count on a device
(:func:`decode_plan`, worked out once by :func:`plan_decode` and then looked up), and the tables of
tiles the compiled loops were measured with. The MoE experts kernel (:mod:`.nm_experts`) plans by
the same rules.
"""
from __future__ import annotations

import torch

from shuffleprune.kernels import gpu
from shuffleprune.kernels.gpu import cdiv, next_pow2

# tensor-core decode tiles by token tile (block_t): (block_r, dense columns per step, warps, the
# programs an SM holds by their registers as compiled for sm_90a), for the split-and-select
# expansions of 2:4 and 4:8 and the generic one of other N:M; float32 (no tensor cores, and
# spilling beyond 16 tokens) decodes at most 16 tokens on one tile
DOT_TILES = {
    (2, 4): {16: (64, 256, 4, 2), 32: (64, 256, 4, 2), 64: (64, 128, 8, 1)},
    (4, 8): {16: (64, 128, 4, 4), 32: (64, 128, 4, 2), 64: (64, 64, 8, 2)},
}
DOT_TILES_OTHER = {16: (16, 256, 4, 4), 32: (32, 256, 4, 4), 64: (64, 128, 8, 1)}
# the same kernel with the weight as the MMA's A operand (``weight_a``, "swap AB": 64 rows per warpgroup
# in the MMA's M, tokens in its N, so Hopper's asynchronous wgmma takes the expanded tile from
# registers and up to 16 stay in flight, where tokens in M (at least 64 for wgmma) fall back to
# synchronous mma with 2–32 tokens). At 2–16 tokens the tile an H100 sweep found fastest
# (tune_swap_decode.json: 64 rows × 256 columns, 2 programs per SM as compiled, 1.04–1.12× cuBLAS on
# 4096×4096 and 11008×4096 unmapped; the narrower 64-column step, 7 per SM, was slower); at 32 and 64
# narrower steps than DOT_TILES (5 — 6 with triton 3.6 — and 4 programs of 2:4 per SM against 2
# and 1: the tensor-core decode was latency-bound at 12.5 % occupancy, ncu_decode.txt). 4:8 at 2–16 tokens:
# 4 per SM (116 registers) until the split-K sum moved into the kernel, 3 since (162, no spill; 128 spills).
DOT_TILES_SWAP = {
    (2, 4): {16: (64, 256, 4, 2), 32: (64, 64, 4, 5), 64: (64, 64, 4, 4)},
    (4, 8): {16: (64, 128, 4, 3), 32: (64, 128, 4, 3), 64: (64, 128, 4, 2)},
}
# the weight-as-A tiles SparseLinear also times (its ``decode_swap_sync``: 32 rows of 2 warps, 128 dense columns
# per step, the synchronous mma) by (block_r, dense columns, warps): the programs an SM holds as compiled for
# sm_90a at 2-16 tokens of 2:4 (shared memory allows 6, registers 9)
DOT_RESIDENT_SWAP = {(32, 128, 2): 6}
# the same with the tile expanded by broadcasts (``spread``, SparseLinear's ``decode_swap_spread_sync``): no
# layout change through shared memory, so 26 KB of pipeline buffers and 88 registers (Triton 3.6; 3.9: 96),
# 8 per SM
DOT_RESIDENT_SWAP_SPREAD = {(32, 128, 2): 8}
# the same with the weight's tiles copied by the Tensor Memory Accelerator (SparseLinear's ``decode_swap_tma``,
# 2:4 on 16-bit inputs, 3 stages), by tokens: (block_r, dense columns, warps, programs per SM as compiled for
# sm_90a). No thread holds the copies' addresses, so at 16 tokens the 64 × 256 tile compiles to 126 registers,
# not 200 (Triton 3.6: 124, not 166), and 3 programs reside per SM (by shared memory), not 2. A step copies at
# least 16 bytes of position words per row (64 kept values), so at 32 and 64 tokens the step is 128 dense
# columns, twice decode_swap's: 114 and 132 registers, 4 and 3 programs per SM (by registers and by shared
# memory: 64 tokens' three take 222 of the SM's 228 KiB), 382 and 404 loop instructions per 64 × 64 kept
# values against decode_swap's 236 and 248 per 64 × 32 (issue ceilings 5.6 and 5.3 TB/s against 4.5 and 4.3)
DOT_TILES_SWAP_TMA = {16: (64, 256, 4, 3), 32: (64, 128, 4, 4), 64: (64, 128, 4, 3)}
DOT_TILE_FP32 = (16, 128, 8, 1)
DECODE_MAX_TOKENS, DECODE_MAX_TOKENS_FP32 = 64, 16
# up to this many tokens the select kernel is the default: on an H100 at 2 tokens it took 12.5–29.7 µs on
# 4096×4096, 4096×11008 and 11008×4096 (tune_select_tokens.json, 1.20–1.35× cuBLAS) where the tensor-core
# decode took 18.2–39.3 (bench_kernel.json); at 4 tokens it is below cuBLAS (19.9 µs against 17.0 on 4096×4096)
SELECT_MAX_TOKENS = 2
SELECT_LIMIT_TOKENS = 16  # the most tokens the select kernel takes (its per-token accumulators grow with them)


def selects(tokens: int, n: int, m: int) -> bool:
    """Whether :func:`plan_decode` puts ``tokens`` of an N:M weight on the select loop by default (1–2
    tokens, any N:M but 4:8, whose select chains 8 slots) rather than on the tensor cores."""
    return tokens <= SELECT_MAX_TOKENS and (n, m) != (4, 8)


def decode_max_tokens(element_bytes: int) -> int:
    """The most tokens :func:`nm_decode` takes for inputs of this element size."""
    return DECODE_MAX_TOKENS_FP32 if element_bytes >= 4 else DECODE_MAX_TOKENS


DECODE_STAGES = 4   # the decode's software pipeline: tiles in flight (fewer where a GPU's shared memory is short)
_PLANS: dict[tuple, dict] = {}   # decode_plan's answers by its arguments and the device facts it reads


def decode_plan(rows: int, kept: int, tokens: int, n: int, m: int, bits: int, device: torch.device,
                block_r: int | None = None, block_k: int | None = None, split: int | None = None,
                stages: int = DECODE_STAGES, num_warps: int | None = None, use_dot: bool | None = None,
                element_bytes: int = 2, weight_a: bool = False, by_group: bool = True, tma: bool = False,
                spread: bool = False) -> dict:
    """:func:`plan_decode`, worked out once per shape, token count, options and device facts (SM count,
    shared memory per SM) and then looked up: the host runs it at every decode launch, and working
    it out took 13–19 µs on a 2-core CPU (``scripts/results/bench_host_overhead.json``), longer than an
    H100's one-token decode of a 4096×4096 layer."""
    key = (rows, kept, tokens, n, m, bits, block_r, block_k, split, stages, num_warps, use_dot, element_bytes,
           weight_a, by_group, tma, spread, gpu.sm_count(device), gpu.smem_per_sm(device))
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = plan_decode(rows, kept, tokens, n, m, bits, device, block_r, block_k, split, stages,
                                         num_warps, use_dot, element_bytes, weight_a, by_group, tma, spread)
    return dict(plan)


def plan_decode(rows: int, kept: int, tokens: int, n: int, m: int, bits: int, device: torch.device,
                block_r: int | None = None, block_k: int | None = None, split: int | None = None,
                stages: int = DECODE_STAGES, num_warps: int | None = None, use_dot: bool | None = None,
                element_bytes: int = 2, weight_a: bool = False, by_group: bool = True, tma: bool = False,
                spread: bool = False) -> dict:
    """Kernel, tile, warps, split-K and pipeline depth for :func:`nm_decode`.

    Up to :data:`SELECT_MAX_TOKENS` tokens take the select kernel (but 4:8), more the tensor-core one
    (``use_dot`` forces either; select takes at most 16). ``weight_a``: the tensor-core kernel
    multiplies with the weight tile as the MMA's A operand (:data:`DOT_TILES_SWAP`), not the inputs;
    ``by_group=False``: the select loop selects per kept value, not by 2:4 group (:func:`select_loop`);
    ``spread``: the tensor-core kernel expands 16-bit 2:4 tiles by broadcasts (:func:`.nm_words.dense_tile`). The
    tiles are the ones whose compiled loop leaves the most room under an H100's issue rate without
    spilling (``scripts/check_kernels_compile.py``): the select kernel's 16 rows × 128 kept values on 4
    warps lets one token stream at up to 5.8 TB/s of instruction issue (4.6 through an index map; Triton
    3.9, by group); the
    tensor-core kernel's 64 rows × 256 dense columns on 4 warps up to 4.2 TB/s at 3–16 tokens on 2:4
    (6.2–6.4 with ``weight_a``) and 3.4 at 32 (4:8: 64 × 128, 3.4 and 2.8 TB/s), 64 × 128 on 8 warps 3.0
    at 64 tokens (2:4 with the byte-permute expansion, :func:`_dense_2of4_pairs`). Other N:M and
    float32 take smaller tiles: larger ones spill. Split-K makes enough programs to fill every SM: one
    per SM for select (an H100's timing: fewer, longer programs beat split-K there), and for the
    tensor-core kernel as many as its pipeline buffers let reside in the SM's shared memory (2 for the
    2:4 tiles; ``tma``, the weight's tiles copied by the Tensor Memory Accelerator: its own tiles,
    :data:`DOT_TILES_SWAP_TMA`). ``stages`` tiles are in the software pipeline. Timed on an H100
    (``scripts/gpu_run.sh tune_decode`` → ``scripts/results/tune_decode_*.json``): at one token these tiles
    unsplit were within 5 % of the best of 32; the tensor-core tiles are within 3 % of the best swept, but
    at about dense speed."""
    fields = 32 // bits
    limit = decode_max_tokens(element_bytes)
    if tokens > limit:
        raise ValueError(f"nm_decode takes at most {limit} tokens of {element_bytes}-byte elements (got {tokens}); "
                         "use nm_gemm")
    if use_dot is None:  # 4:8's select chains 8 slots (2.2 TB/s at one token), its expansion does not (3.6)
        use_dot = not selects(tokens, n, m)
    if tma and not (use_dot and weight_a and (n, m) == (2, 4) and element_bytes == 2):
        raise ValueError("tma takes the weight-as-A tensor-core decode (use_dot, weight_a) of 2:4 on 16-bit inputs")
    if spread and (tma or not (use_dot and (n, m) == (2, 4) and element_bytes == 2)):
        raise ValueError("spread takes the tensor-core decode (use_dot, no tma) of 2:4 on 16-bit inputs")
    if not use_dot and tokens > SELECT_LIMIT_TOKENS:
        raise ValueError(f"the select decode takes at most {SELECT_LIMIT_TOKENS} tokens (got {tokens})")
    block_t = max(16, next_pow2(tokens)) if use_dot else next_pow2(tokens)  # tl.dot: ≥ 16
    if use_dot:
        table = DOT_TILES_SWAP if weight_a else DOT_TILES
        tile = DOT_TILE_FP32 if element_bytes >= 4 else DOT_TILES_SWAP_TMA[block_t] if tma else \
            table.get((n, m), DOT_TILES_OTHER)[block_t]
        block_r = block_r or tile[0]
        block_k = block_k or max(fields, n, tile[1] * n // m)
        num_warps = num_warps or tile[2]
        if block_r < 16 or block_k // n * m < 16:
            raise ValueError(f"the tensor-core decode needs block_r ≥ 16 and block_k·M/N ≥ 16 (got {block_r}, {block_k})")
        if tma and block_k * bits < 128:
            raise ValueError(f"tma copies at least 16 bytes of position words per row: at least {128 // bits} kept "
                             f"values per step (got {block_k})")
    else:
        block_r = block_r or 16
        block_k = block_k or max(fields, n, 128)
        num_warps = num_warps or (8 if tokens > 2 else 4)
    row_programs = cdiv(rows, block_r)
    steps = cdiv(kept, block_k)
    per_sm = 1   # select: split only when the rows leave SMs idle (an H100 timed split-K's partial sums
                 # and their reduction as slower than one program per SM streaming more rows)
    if use_dot:  # as many as the registers (the tile's compile) and the pipeline's buffers let reside
        buffers = max(1, stages - 1) * (block_r * block_k * element_bytes + block_r * block_k * bits // 8
                                        + block_t * block_k * m // n * element_bytes)   # stages − 1 loads ahead
        if (block_r, num_warps) == (tile[0], tile[2]):
            by_registers = tile[3]
        else:   # another tile SparseLinear times, or one being tuned: up to 4
            resident = DOT_RESIDENT_SWAP_SPREAD if spread else DOT_RESIDENT_SWAP
            by_registers = resident.get((block_r, block_k * m // n, num_warps), 4) if weight_a else 4
        per_sm = max(1, min(by_registers, gpu.smem_per_sm(device) // buffers))
    if split is None:
        slots = per_sm * gpu.sm_count(device)
        split = max(1, min(steps, cdiv(slots, row_programs)))
        if use_dot:  # the split with the fewest waves per unit of work (ties: fewer partial sums)
            split = min(range(1, min(steps, 2 * split) + 1),
                        key=lambda s: (cdiv(row_programs * s, slots) / s, s))
    per_split = cdiv(steps, split) * block_k
    split = cdiv(kept, per_split)
    return dict(block_r=block_r, block_k=block_k, block_t=block_t, split=split, per_split=per_split, stages=stages,
                num_warps=num_warps, use_dot=use_dot, per_sm=per_sm, weight_a=weight_a and use_dot,
                by_group=by_group or use_dot, tma=tma, spread=spread)
