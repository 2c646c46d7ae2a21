"""``SparseLinear``: the deployed form of a pruned (and possibly permuted) linear layer.

``y = W_p · x[perm] + b`` with ``W_p`` held compressed only (``values`` + packed positions, see
:mod:`format`) and ``perm`` the input index map (``None`` when the layer reads its input in order).
No layer keeps a dense copy: GPU memory holds the compressed size. Implementations (``IMPLS``):

- ``decode`` (CUDA, 1–64 tokens; float32 1–16): the bandwidth kernel of ``kernels/nm_decode.py``
  (position words, split-K) over the gathered input (one gather, shared by a group's layers; every
  implementation but ``decode_mapped``, ``gather`` and ``group`` reads its input so, gathered the way
  ``deploy/input_gather.py`` measured fastest for its width and token count);
- ``decode_mapped``: the same kernel reading the index map itself (no gather launch; on an H100 its
  gather, a synchronous load inside the loop, cost 6–34 % at one token and far more on the tensor
  cores). It now reads the gather as 32-bit words the pipeline copies ahead, in the select loop (1–2
  tokens) and above that, to 16 tokens (``MAPPED_MAX_TOKENS``), in the weight-as-A tensor-core
  decode (``decode_swap``'s kernel, the one whose word gather compiles without spilling); not yet
  timed;
- ``decode_offsets`` (a map within aligned blocks of at most 256 columns, as ``prune`` writes them):
  ``decode_mapped`` reading the map as 1-byte offsets within its blocks (``block_map``), a quarter of
  the int32 map's bytes per step; built after the H100 put the in-kernel map's cost at one token at
  1–9 % under a 64-column block map (``bench_kernel.json``, 2026-11-27). Timed on the H100 the same
  day it ran 5–14 % slower than ``decode_mapped`` at 1–2 tokens, so ``auto`` no longer weighs it
  (``NOT_WEIGHED``); it runs when named;
- ``decode_shallow`` (1–2 tokens): ``decode`` with its software pipeline one tile shallower (3 tiles
  in flight, not 4). An H100 sweep of the select loop at one token (``tune_decode_select.json``) had
  it fastest on 11008×4096 (23.1 against 24.5 µs) and slower on 4096×4096 and 4096×11008 (2–4 %),
  so ``auto`` times both rather than a rule choosing by shape (on the H100 on 2026-11-27 it was
  ``auto``'s pick in 3 of its 18 one-token rows, on 11008×4096 and 14336×4096);
- ``decode_tall`` (one token), ``decode_wide`` (1–2 tokens), ``decode_mapped_tall`` and
  ``decode_mapped_wide`` (one token; 16-bit inputs, any N:M but 4:8): ``decode`` and ``decode_mapped`` with
  the select loop's other tiles, 32 rows per program or 256 kept values per step
  (``DECODE_KERNELS_TILE``). An H100 sweep had them 2–6 % faster than the default tile on a tall or
  a wide shape and not on the square one (``tune_gather.json``), so ``auto`` times them. Timed as
  candidates on the H100 (2026-11-27), the three others were ``auto``'s picks in 15 of its 36 one- and
  two-token rows (11 of 18 at one token), ``decode_tall`` in none, so ``auto`` no longer weighs it
  (``NOT_WEIGHED``);
- ``decode_mapped_by_value`` (2:4, 16-bit, 1–2 tokens): ``decode_mapped`` with the select loop of
  before 2026-11-28, each kept value selecting its input in a 4-D tile, instead of the loop by 2:4
  group (``nm_decode.select_loop``). Compiled for sm_90a the group loop is the shorter under Triton
  3.9 and 3.6 alike (one token through the map: 232 and 231 instructions per step against 283 and
  276, ``kernel_compile_sm90*.json``), but only the per-value loop has ever been timed on a GPU, so
  ``auto`` times both through the map and a GPU run of ``bench_kernel`` compares them;
- ``decode_resident`` (2:4, 16-bit, 1–2 tokens; with a map or without): ``kernels/nm_resident.py``, where a
  program owns a chunk of 256 kept values and a range of rows, reads its chunk's inputs once (through
  the map) before its loop and streams the rows past them, each row's partial sum per chunk added by
  the last program of its range. Built so a map costs what no map costs: compiled for sm_90a its loop
  has 10.75 instructions per kept value through the map and without (the select decode: 14.5 and
  11.4), ``kernel_compile_sm90.json``. Not yet timed on a GPU, so ``auto`` times it. Named as a policy,
  it runs ``decode_mapped`` where it does not apply (more tokens, another pattern, 32-bit values);
- ``decode_resident_tma`` (as ``decode_resident``): the resident decode with its weight's tiles copied by the
  Tensor Memory Accelerator (as ``decode_swap_tma``, below; no head prefetch). Not yet timed on a GPU;
  ``auto`` weighs it where the descriptors can read the weight, and named elsewhere it runs
  ``decode_resident``;
- ``decode_select`` (3–16 tokens): the decode forced onto the select-and-add loop of 1–2 tokens
  instead of the tensor cores (on an H100 the tensor-core decode ran at about dense speed from 2
  tokens on, the select loop 1.5× faster than dense at one token and 1.2–1.35× at two);
- ``decode_swap`` (2–64 tokens): the tensor-core decode with the weight tile as the MMA's A operand
  (rows in the MMA's M: Hopper's asynchronous wgmma from registers), built after the tensor-core
  decode measured at about dense speed, latency-bound;
- ``decode_swap_narrow`` (2:4, 2–16 tokens): ``decode_swap`` with half its step (64 kept values, 128
  dense columns) and 3 tiles in flight. An H200 sweep (``tune_bw_swap.json``, 2026-11-28) had it fastest
  on 11008×4096 (24.7–25.7 µs at 2–16 tokens against the default tile's 28.2–29.0 and cuBLAS's
  25.5–26.8) and slower on 4096×4096 and 4096×14336; on the H100 the same step had been slower on
  all three (``tune_swap_decode.json``), so ``auto`` times it rather than a rule;
- ``decode_swap_sync`` (2:4, 2–16 tokens): ``decode_swap`` on 32 rows of 2 warps and 64 kept values
  per step, which Triton compiles to the warp-synchronous ``mma`` instead of the warpgroup's
  asynchronous ``wgmma`` (the H100 and H200 sweeps covered only 64 and 128 rows, all wgmma). The wgmma
  decode ran at 1.8 TB/s on the H200 where its loop's instructions alone would allow about 6: bound
  by latency, with at most one wgmma group in flight per warpgroup (``WARPGROUP.DEPBAR.LE gsb0, 0x1``
  in its sm_90a loop) and 2 programs per SM. As compiled for sm_90a
  (``scripts/results/kernel_compile_sm90.json``), 6 such programs (12 warps) reside per SM where the
  default tile has 2 (8 warps), with about the same instruction ceiling (5.1–5.5 against 5.9–6.4 TB/s).
  Not yet timed on a GPU; ``auto`` weighs it;
- ``decode_swap_tma`` (2:4, 16-bit, 2–64 tokens): ``decode_swap`` (3 tiles in flight) with its weight's tiles
  copied by Hopper's Tensor Memory Accelerator (tensor descriptors), not by every thread's 16-byte
  asynchronous copies. At 2–16 tokens the 2:4 decodes took the H100's time on the H200 (4096×14336, 2
  tokens: 34.6 against 34.7 µs) where cuBLAS, whose loads are bulk copies, sped up with the H200's 1.4×
  bandwidth (32.7 against 46.1): what the threads' copies keep in flight per SM may be what binds them.
  Compiled for sm_90a no thread holds the copies' addresses: 126 registers against 200 and 3 programs
  per SM against 2, with the same loop (665 instructions against 669 at 16 tokens,
  ``kernel_compile_sm90.json``). At 32–64 tokens a step copies 64 kept values per row (the descriptors'
  16 bytes of position words), twice ``decode_swap``'s step there (``nm_decode.DOT_TILES_SWAP_TMA``). Not yet
  timed on a GPU; ``auto`` weighs it where the descriptors can read the weight (rows of a multiple of 16
  bytes, values of the inputs' dtype), and named elsewhere it runs ``decode_swap``;
- ``gemm`` (CUDA, more than 16 tokens): the tiled Triton GEMM that decompresses weight tiles in
  registers, over the gathered input; ``gemm_swap``: the same with the weight as the A operand, so
  the tensor-core call overlaps the next tile's expansion; ``gemm_swap_tall`` (16-bit inputs): that on
  128 weight rows per program, so each input tile read from L2 serves twice the rows
  (``nm_gemm.GEMM_TILES_SWAP_TALL`` says why);
- ``scratch`` (any device): ``W_p`` decompressed into one scratch buffer shared by every layer of
  that device and dtype, then a dense matmul (cuBLAS on the GPU);
- ``scratch_mapped`` (CUDA, a mapped layer, from 17 tokens): the weight decompressed into that scratch
  in the input's *original* order (``kernels/nm_gemm.py``'s ``nm_decompress_mapped_into``), then a
  dense matmul of the input as it is: no gathered copy of a prompt's activation is made or read;
- ``gather`` / ``group``: the first Triton kernels (``kernels/nm_matmul.py``), kept as candidates;
- ``semi_structured`` / ``semi_cutlass``: PyTorch's 2:4 tensors; ``cslt``: cuSPARSELt called directly
  (Hopper's sparse tensor cores), its algorithm and split-K searched once per token count and the
  output's transpose fused. On a layer in the export's layout they hold their own compressed copy,
  so only an explicit ``policy`` runs them (benchmarks). After :meth:`SparseLinear.use_cslt_layout`
  the layer's one buffer *is* cuSPARSELt's (``deploy/cslt_layout.py``): the decode kernels read it
  and ``auto`` times ``cslt`` on it from 17 tokens.

``policy="auto"``: on the CPU ``scratch``; on CUDA the first call of each token-count bucket
(1, 2, 4, … tokens) checks the applicable candidates' outputs against PyTorch's (dropping one that
disagrees), times them, each as a CUDA graph of repeated calls (so the host's launch cost, which
graphs remove, does not decide) that cycle through copies of the weight larger together than the L2
(so each call reads its weight from DRAM, as a model's layers do: one 2:4 weight of a 7B model fits
in an H100's L2, and timed alone it is read from there), and keeps the fastest
(``self.choices``); a first call made during a graph capture takes :func:`default_choice`. Where
that is one whose eager call costs more than its replay (``EAGER_CHECKED``: PyTorch builds
cuSPARSELt's plan on every ``_cslt_sparse_mm`` call before its 2026 fix, about half a millisecond on an
H100; the TMA-fed decodes make two tensor descriptors per call, which the launcher encodes at each
launch), it is timed eagerly against the fastest other candidate too, and calls outside a capture run
the eager winner (``self.eager_choices``): a model served with CUDA graphs prefills on the sparse
tensor cores, and one run eagerly (``generate`` without graphs) does not pay the plan, or the
descriptors, per call. The
choices are shared by every layer of the same shape, pattern, bias and map span (none, a map within
blocks of 64 columns as ``prune`` makes, one over all columns: ``input_gather.map_span``, since how far
the map jumps decides what reading through it costs) on that device and dtype, so a 32-block model
measures each kind of layer once, not 32 times (``release_choices`` forgets them).
On Hopper and later the two fastest Triton kernels of the word layout (decode and GEMM) are timed
once more launched as programmatic dependents (``decode+pdl``, ``gemm_swap+pdl`` and so on,
``kernels/overlap.py``: each call's kernels start while the previous call's end and prefetch the
first part of their weight into L2; a mapped input's gather is then the Triton gather that lets the
kernel start early, not ``index_select``), and the fastest of all is kept (a plain launch on a tie).
"""
from __future__ import annotations

import itertools
import warnings
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from shuffleprune.deploy.format import decompress, meta_bits
from shuffleprune.deploy.input_gather import gather_input, map_span, release_gather_choices, token_bucket
from shuffleprune.runtime import candidate_errors, capturing, cuda_graph_ms, eager_ms, outside_graph_pools

LIBRARY_IMPLS = ("semi_structured", "semi_cutlass", "cslt")   # CUDA libraries' 2:4 GEMMs, each on its own copy
# nm_gemm's options per prompt policy (on the gathered input): the weight as the MMA's B operand, as its A
# operand, and as A over 128 rows per program
GEMM_KERNELS = {"gemm": {}, "gemm_swap": {"weight_a": True}, "gemm_swap_tall": {"weight_a": True, "tall": True}}
IMPLS = ("decode", "decode_shallow", "decode_tall", "decode_wide", "decode_mapped", "decode_mapped_tall",
         "decode_mapped_wide", "decode_mapped_by_value", "decode_offsets", "decode_resident", "decode_resident_tma",
         "decode_select", "decode_swap", "decode_swap_narrow", "decode_swap_sync", "decode_swap_tma", *GEMM_KERNELS,
         "scratch", "scratch_mapped", "gather", "group", *LIBRARY_IMPLS)
# candidates timed eagerly as well when a CUDA graph's timing picks them (plain or ``+pdl``): their eager calls
# cost the host more than their replays. cuSPARSELt builds its plan per call (PyTorch before its 2026 fix); the
# TMA decodes make two tensor descriptors per call (fast_launch.json, this project's 2-core CPU: 39.6 against
# the plain decode's 24.8 µs of host time per 16-token call, the launch recorded, not run) and the launcher
# encodes them at each launch
EAGER_CHECKED = ("cslt", "decode_swap_tma", "decode_resident_tma")
GEMM_MIN_TOKENS = 17   # below this the decode kernel's split-K tiles always win
GATHER_MAX_TOKENS = 16
# decode_mapped is timed up to this many tokens: above it the word gather holds the weight-as-A tiles to
# fewer programs per SM than decode_plan sizes split-K for (2 where DOT_TILES_SWAP says 4 at 64 tokens, as
# compiled), and on an H100 the in-kernel map ran 5.6–7.5× slower than the gathered input at 64 tokens
MAPPED_MAX_TOKENS = 16
# the select loop's other tiles (``_tall``: 32 rows per program; ``_wide``: 256 kept values per step), each
# on the gathered input and reading the map itself, which auto weighs up to these token counts (the module
# docstring says why)
DECODE_KERNELS_TILE = {"tall": {"block_r": 32}, "wide": {"block_k": 256}}
# policies auto no longer weighs (still run when named): on an H100 (2026-11-27, bench_kernel.json, 126 auto rows)
# neither was ever picked; decode_offsets ran 5–14 % slower than decode_mapped under the same block map at 1–2
# tokens on all six shapes and within 1.6 % either way at 4–16, decode_tall within 1 % of the default tile at best
NOT_WEIGHED = ("decode_tall", "decode_offsets")
# the most tokens auto weighs these at (and bench_kernel times them at; decode_resident: nm_resident's own limit)
TILE_MAX_TOKENS = {"decode_tall": 1, "decode_wide": 2, "decode_mapped_tall": 1, "decode_mapped_wide": 1,
                   "decode_mapped_by_value": 2, "decode_resident": 2, "decode_resident_tma": 2,
                   "decode_swap_narrow": 16, "decode_swap_sync": 16,
                   "decode_swap_tma": 64}
SWAP_TILES = ("decode_swap_narrow", "decode_swap_sync")   # decode_swap's other tiles: 2:4, 16-bit, 2-16 tokens
# nm_decode's kernel choice per decode policy: all but the MAPPED_DECODES run on the gathered input;
# decode_mapped reads the map itself, above the select loop's tokens in the weight-as-A kernel (the
# tensor-core form whose gather the pipeline copies ahead)
DECODE_KERNELS = {"decode": {}, "decode_shallow": {"stages": 3}, "decode_mapped": {"weight_a": True},
                  "decode_mapped_by_value": {"weight_a": True, "by_group": False},
                  "decode_offsets": {"weight_a": True},
                  "decode_select": {"use_dot": False},
                  "decode_swap": {"use_dot": True, "weight_a": True},
                  "decode_swap_narrow": {"use_dot": True, "weight_a": True, "block_k": 64, "stages": 3},
                  "decode_swap_sync": {"use_dot": True, "weight_a": True, "block_r": 32, "num_warps": 2, "block_k": 64},
                  "decode_swap_tma": {"use_dot": True, "weight_a": True, "stages": 3, "tma": True},
                  **{f"{name}_{shape}": {**DECODE_KERNELS_TILE[shape], **kw}
                     for name, kw in (("decode", {}), ("decode_mapped", {"weight_a": True}))
                     for shape in ("tall", "wide")}}
# the decodes that read the index map themselves (the others read the gathered input)
MAPPED_DECODES = (*(name for name in DECODE_KERNELS if name.startswith("decode_mapped")), "decode_offsets")
# the name of one of these (the Triton kernels of the word layout) with this suffix launches it as a
# programmatic dependent (its gather too): on Hopper it starts while the kernel before it ends,
# prefetching its weight (kernels/overlap.py)
PDL_KERNELS = (*DECODE_KERNELS, "decode_resident", *GEMM_KERNELS)
PDL_SUFFIX = "+pdl"
PDL_RETIMED = 2   # the fastest of PDL_KERNELS auto times again launched so (the order may change: a separate
                  # gather's launch is what a dependent launch hides best)
PDL_RETIME_WITHIN = 1.3   # and any other of them within this factor of the fastest candidate: on an H100 (2026-11-27,
                          # bench_kernel.json) a dependent launch made a decode up to 1.24× faster, and the winners
                          # at 2 tokens (1024×4096: decode 9.2 → 7.4 µs; 4096×4096: decode_swap 16.0 → 13.9) were
                          # 3rd–5th without it, so the two fastest alone missed them
COLD_L2 = 2.5     # auto times each candidate over copies of the weight that together exceed the L2 this many
                  # times, so no call finds its weight there (in a model every layer's weight comes from DRAM)

_SCRATCH: dict[tuple[str, torch.dtype], torch.Tensor] = {}
_CHOICES: dict[tuple, tuple[str, str]] = {}   # (device, dtype, rows, cols, N, M, map span, bias?, tiled?, bucket)
                                              # → (implementation in a CUDA graph, implementation eagerly)


def scratch_buffer(numel: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The shared scratch of ``device`` and ``dtype``, grown to at least ``numel`` elements (it lives
    as long as the process, outside any CUDA graph pool but a capture's; every layer's dense form is
    written into it per call)."""
    key = (str(device), dtype)
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < numel:
        _SCRATCH.pop(key, None)
        buf = _SCRATCH[key] = outside_graph_pools(lambda: torch.empty(numel, dtype=dtype, device=device), device)
    return buf


def release_scratch() -> None:
    """Free the shared scratch buffers (they are rebuilt on the next call that needs one)."""
    _SCRATCH.clear()


_CSLT_CONFIGS: dict[tuple, tuple[int, ...]] = {}   # (device, dtype, rows, cols, bias?, tokens) → cslt_search's
                                                   # configuration: one search per kind of layer, as _CHOICES


def release_choices() -> None:
    """Forget the implementations ``auto`` measured, cuSPARSELt's searched configurations and the input
    gathers' measured orders (the next call of each kind of layer measures again)."""
    _CHOICES.clear()
    _CSLT_CONFIGS.clear()
    release_gather_choices()


class InputShared:
    """A tensor computed once from an input and shared by ``members`` readers while the input is the
    same object, unmodified; let go once every member has read it (0 members: kept until the next
    input), so no cache outlives its use (peak memory; a CUDA graph pool's tensors held by Python
    state are what ``torch.compile``'s CUDA graphs refuse)."""

    def __init__(self, members: int = 0) -> None:
        self.members = members
        self.release()

    def get(self, x: torch.Tensor, reader: int, compute: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``compute(x)``, computed at the first read of ``x`` (``reader``: who reads, by id)."""
        if x is not self._source or x._version != self._version:   # held, so its memory cannot be reused
            self._source, self._version, self._value, self._readers = x, x._version, compute(x), set()
        value = self._value
        self._readers.add(reader)
        if len(self._readers) == self.members:   # every member has read it
            self.release()
        return value

    def release(self) -> None:
        """Let go of the input and the computed tensor."""
        self._source: torch.Tensor | None = None
        self._version = -1
        self._value: torch.Tensor | None = None
        self._readers: set[int] = set()


class SharedGather(InputShared):
    """One gathered input ``x[..., perm]`` shared by the layers of a group that read the same input
    through the same index map (q/k/v, gate/up): the first layer gathers (:meth:`get` with its gather),
    the others reuse it while the input tensor is the same object, unmodified. Layers join with
    :meth:`join`."""

    def join(self) -> "SharedGather":
        """Count one more layer reading through this gather; returns it."""
        self.members += 1
        return self


class SparseLinear(nn.Module):
    """A compressed N:M linear layer with an optional input index map."""

    def __init__(self, values: torch.Tensor, meta: torch.Tensor, in_features: int, n: int, m: int,
                 perm: torch.Tensor | None = None, bias: torch.Tensor | None = None, policy: str = "auto"):
        super().__init__()
        if policy != "auto" and policy not in IMPLS and split_pdl(policy)[0] not in PDL_KERNELS:
            raise ValueError(f"unknown SparseLinear policy {policy!r}; use auto or one of {', '.join(IMPLS)} "
                             f"(a decode or gemm one may end in {PDL_SUFFIX})")
        self.in_features, self.out_features = in_features, values.shape[0]
        self.n, self.m, self.bits = n, m, meta_bits(m)
        self.register_buffer("values", values)
        self.register_buffer("meta", meta)
        self.register_buffer("perm", None if perm is None else perm.to(torch.int32))
        # how far the map jumps (map_span below): read now from a map on the host, else at the first call
        # outside a CUDA graph capture (a device map's read synchronizes, which no capture allows)
        self._span = None if perm is None or perm.device.type != "cpu" else map_span(perm)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.policy = policy
        self.shared_gather: SharedGather | None = None  # set by export's loader for layers sharing a map
        self.fused_inputs = None  # a fused_inputs.FusedInputs when this layer runs stacked with others
        self.choices: dict[int, str] = {}         # token bucket → implementation inside a CUDA graph capture
        self.eager_choices: dict[int, str] = {}   # token bucket → implementation outside one
        self._semi: dict[str, object] = {}
        self._words: tuple[torch.Tensor, torch.Tensor] | None = None  # (meta it was made from, its int32 words)
        self._inverse: tuple[torch.Tensor, torch.Tensor] | None = None  # (perm it was made from, its int32 inverse)
        self._offsets: tuple[torch.Tensor, tuple[torch.Tensor, int]] | None = None  # (perm, block_map())
        self.tiled = False   # meta holds cuSPARSELt's metadata words (use_cslt_layout), values and meta one buffer
        self._packed: torch.Tensor | None = None
        self._register()

    def _register(self) -> None:
        """A key of this layer's own, by which the compiled op (:func:`sparse_linear_op`) finds it."""
        self._key = next(_KEYS)
        _LAYERS[self._key] = self

    def __setstate__(self, state: dict) -> None:   # a deepcopy or unpickled copy is a layer of its own
        super().__setstate__(state)
        self._register()

    def __setattr__(self, name: str, value) -> None:
        """A map assigned anew (``layer.perm = …``) is another map: its span is read again (from a host
        map at once, else at the next call outside a capture). ``.to()`` moves the same map and keeps it."""
        super().__setattr__(name, value)
        if name == "perm" and "_span" in self.__dict__:
            self._span = None if value is None or value.device.type != "cpu" else map_span(value)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, {self.n}:{self.m}, "
                f"perm={'yes' if self.perm is not None else 'no'}, bias={self.bias is not None}")

    @property
    def map_span(self) -> int | None:
        """How far the index map jumps (:func:`~shuffleprune.deploy.input_gather.map_span`; None without a
        map): ``auto`` and the gathers measure maps of different spans apart, since a map within blocks of
        64 columns (``prune``'s) reads the input nearly in order and one over all columns does not. Read
        from the map the layer was built with (a layer given its map on a device reads it at its first call
        outside a CUDA graph capture; inside one, None until then)."""
        if self.perm is None:   # no map, or it moved to the producer
            return None
        if self._span is None and not capturing(self.perm):
            self._span = map_span(self.perm)
        return self._span

    @property
    def weight(self) -> torch.Tensor:
        """The dense weight in the *original* input order (zeros where pruned), built on each access —
        for inspection and for code that reads ``.weight``; the forward pass never uses it."""
        w = self.dense_permuted()
        if self.perm is None:
            return w
        out = torch.empty_like(w)
        out[:, self.perm.long()] = w
        return out

    def dense_permuted(self) -> torch.Tensor:
        """``W_p`` decompressed into a new tensor (not kept)."""
        return decompress(self.values, self.export_meta(), self.n, self.m, self.in_features)

    def export_meta(self) -> torch.Tensor:
        """The positions in the export's byte layout (``meta`` itself, or rebuilt from cuSPARSELt's order)."""
        if not self.tiled:
            return self.meta
        from shuffleprune.deploy.cslt_layout import row_words

        return row_words(self.meta).view(torch.uint8)

    def words(self) -> torch.Tensor:
        """The positions as int32 words for the Triton kernels (a view of ``meta`` when rows are whole
        words, which they are for every width divisible by 32·M/(N·bits)); after
        :meth:`use_cslt_layout`, ``meta`` itself, in cuSPARSELt's order (the kernels' ``tiled``)."""
        from shuffleprune.kernels.nm_words import position_words

        if self.tiled:
            return self.meta
        if self._words is None or self._words[0] is not self.meta:  # rebuilt only when meta is replaced (.to())
            self._words = (self.meta, outside_graph_pools(lambda: position_words(self.meta), self.meta))
        return self._words[1]

    def use_cslt_layout(self) -> bool:
        """Hold ``values`` and the positions as one cuSPARSELt buffer (:mod:`.cslt_layout`): the decode
        kernels read it and ``auto`` adds cuSPARSELt (Hopper's sparse tensor cores) to its prefill
        candidates, without a second copy. Only 2:4, 16-bit, rows a multiple of 64 and columns of 32,
        and not for a layer stacked with others; returns whether the layer now has that layout.
        Call it where the layer lives (``.to()`` afterwards rebuilds the buffer once on its next call)."""
        from shuffleprune.deploy.cslt_layout import cslt_buffer, cslt_supported, split_buffer

        if self.tiled:
            return True
        if self.fused_inputs is not None or not cslt_supported(self.out_features, self.in_features, self.n, self.m,
                                                                self.values.dtype):
            return False
        packed = cslt_buffer(self.values, self.words())
        self.values, self.meta = split_buffer(packed)
        self._packed, self.tiled, self._words = packed, True, None
        self._semi.pop("cslt", None)        # a compressed copy made before, now redundant
        self.forget_choices()
        return True

    def forget_choices(self) -> None:
        """Measure again at the next call (the layer's layout or input order changed)."""
        self.choices.clear()
        self.eager_choices.clear()

    def _packed_buffer(self) -> torch.Tensor:
        """The cuSPARSELt buffer ``values`` and ``meta`` are views of (made again, once, after ``.to()``
        copied them apart)."""
        from shuffleprune.deploy.cslt_layout import join_buffer, split_buffer

        p = self._packed
        if p is None or self.values.untyped_storage().data_ptr() != p.untyped_storage().data_ptr() or \
                self.values.device != p.device:
            p = self._packed = outside_graph_pools(lambda: join_buffer(self.values, self.meta), self.values)
            self.values, self.meta = split_buffer(p)
        return p

    def _gathered(self, x: torch.Tensor, pdl: bool = False) -> torch.Tensor:
        """``x[..., perm]`` (shared with the layers of the same map and input) by the gather measured
        fastest for this input (:func:`~shuffleprune.deploy.input_gather.gather_input`); ``pdl``: by a
        Triton gather that lets the next kernel start early."""
        if self.perm is None:
            return x
        def gather(t: torch.Tensor) -> torch.Tensor:
            return gather_input(t, self.perm, pdl, self.map_span)

        if self.shared_gather is not None:
            return self.shared_gather.get(x, id(self), gather)
        return gather(x)

    def _pow2(self) -> bool:
        return not (self.n & (self.n - 1) or self.m & (self.m - 1))

    def inverse_map(self) -> torch.Tensor:
        """The index map's inverse as int32 (``inverse[perm[j]] = j``), made once per map (again after
        ``.to()`` replaced it)."""
        if self._inverse is None or self._inverse[0] is not self.perm:
            perm = self.perm
            self._inverse = (perm, outside_graph_pools(lambda: torch.argsort(perm).to(torch.int32), perm))
        return self._inverse[1]

    def _offsets_apply(self) -> bool:
        """Whether the map fits ``decode_offsets``: within aligned blocks of at most 256 columns (as ``prune``
        writes them), its width a multiple of 4."""
        from shuffleprune.kernels.nm_decode import MAX_BLOCK_SPAN

        span = self.map_span
        return span is not None and span <= MAX_BLOCK_SPAN and self.in_features % 4 == 0

    def block_map(self) -> tuple[torch.Tensor, int] | None:
        """The map as 1-byte offsets within its blocks and their span (``decode_offsets``), made once per
        map, outside any CUDA graph capture (inside one with none made yet, and for a map that jumps
        further: None, and the int32 map is read)."""
        if not self._offsets_apply():
            return None
        if self._offsets is None or self._offsets[0] is not self.perm:
            if capturing(self.perm):
                return None
            from shuffleprune.kernels.nm_decode import block_map_offsets

            perm, span = self.perm, self.map_span
            self._offsets = (perm, (outside_graph_pools(lambda: block_map_offsets(perm, span), perm), span))
        return self._offsets[1]

    def _maps_into_scratch(self) -> bool:
        """Whether ``scratch_mapped`` applies: a mapped layer in the export's layout (not cuSPARSELt's), N and M
        powers of two, rows narrow enough for the kernel's shared memory."""
        from shuffleprune.kernels.nm_gemm import mapped_fits

        return self.perm is not None and not self.tiled and mapped_fits(self.in_features, self.n, self.m,
                                                                        self.values.dtype)

    def _scratch_mapped(self) -> torch.Tensor:
        """The weight in the input's original order (``W_p[:, inverse]``) written into the shared scratch."""
        from shuffleprune.kernels.nm_gemm import nm_decompress_mapped_into

        if self.tiled:
            raise ValueError("scratch_mapped reads the export's layout; this layer holds cuSPARSELt's (use_cslt_layout)")
        buf = scratch_buffer(self.out_features * self.in_features, self.values.device, self.values.dtype)
        return nm_decompress_mapped_into(self.values, self.words(), self.n, self.m, self.bits, self.in_features,
                                         self.inverse_map(), buf)

    def _scratch_dense(self) -> torch.Tensor:
        """``W_p`` written into the shared scratch (a Triton kernel on CUDA, PyTorch elsewhere)."""
        buf = scratch_buffer(self.out_features * self.in_features, self.values.device, self.values.dtype)
        if self.values.is_cuda and self._pow2():
            from shuffleprune.kernels.nm_gemm import nm_decompress_into

            return nm_decompress_into(self.values, self.words(), self.n, self.m, self.bits, self.in_features, buf,
                                      tiled=self.tiled)
        return decompress(self.values, self.export_meta(), self.n, self.m, self.in_features, out=buf)

    def _run(self, impl: str, x: torch.Tensor) -> torch.Tensor:
        impl, pdl = split_pdl(impl)
        if impl in ("decode_resident", "decode_resident_tma"):   # reads the map itself, once per program
            from shuffleprune.kernels.nm_resident import nm_decode_resident, resident_applies

            if resident_applies(x.numel() // x.shape[-1], self.n, self.m, self.values):
                return nm_decode_resident(x, self.values, self.words(), self.n, self.m, self.bits, self.perm,
                                          self.bias, tiled=self.tiled, pdl=pdl,
                                          tma=impl == "decode_resident_tma" and self._tma_applies(x, resident=True))
            impl = "decode_mapped"   # more tokens, another pattern or 32-bit values: the decode reading the map
        if impl == "decode_swap_tma" and not self._tma_applies(x):
            impl = "decode_swap"   # a weight or input the tensor descriptors cannot read
        if impl in DECODE_KERNELS:
            from shuffleprune.kernels.nm_decode import nm_decode

            in_kernel = impl in MAPPED_DECODES
            inp, perm = (x, self.perm) if in_kernel else (self._gathered(x, pdl), None)
            return nm_decode(inp, self.values, self.words(), self.n, self.m, self.bits, perm, self.bias,
                             tiled=self.tiled, pdl=pdl, block_map=self.block_map() if impl == "decode_offsets" else None,
                             **DECODE_KERNELS[impl])
        if impl in GEMM_KERNELS:
            from shuffleprune.kernels.nm_gemm import nm_gemm

            return nm_gemm(self._gathered(x, pdl), self.values, self.words(), self.n, self.m, self.bits, self.bias,
                           tiled=self.tiled, pdl=pdl, **GEMM_KERNELS[impl])
        if impl in ("gather", "group"):
            from shuffleprune.kernels.nm_matmul import nm_gather_matmul

            return nm_gather_matmul(x, self.values, self.export_meta(), self.n, self.m, self.bits, self.perm,
                                    self.bias, variant=impl)
        if impl == "cslt":
            return self._cslt(x)
        if impl in ("semi_structured", "semi_cutlass"):
            if impl not in self._semi:
                from torch.sparse import SparseSemiStructuredTensorCUTLASS, to_sparse_semi_structured

                w = self.dense_permuted()
                self._semi[impl] = outside_graph_pools(
                    lambda: to_sparse_semi_structured(w) if impl == "semi_structured"
                    else SparseSemiStructuredTensorCUTLASS.from_dense(w), w)
            xg = self._gathered(x)
            y = F.linear(xg.reshape(-1, xg.shape[-1]), self._semi[impl]).reshape(*x.shape[:-1], self.out_features)
            return y if self.bias is None else y + self.bias
        if impl == "scratch_mapped":
            return F.linear(x, self._scratch_mapped() if self.perm is not None else self._scratch_dense(), self.bias)
        return F.linear(self._gathered(x), self._scratch_dense(), self.bias)

    def _cslt(self, x: torch.Tensor) -> torch.Tensor:
        """``x[..., perm] @ W_pᵀ + b`` by cuSPARSELt with the configuration its search finds fastest for
        this shape and token count, searched eagerly at the first call of each (``_CSLT_CONFIGS``,
        shared by every layer of that shape: ``auto`` measures one of them, and the others' first
        call may be inside a CUDA graph capture, where nothing is searched and cuSPARSELt's default
        configuration runs): on the layer's own buffer after :meth:`use_cslt_layout`, else on a
        compressed copy made at the first call."""
        if self.tiled:
            packed = self._packed_buffer()
        else:
            if "cslt" not in self._semi:
                self._semi["cslt"] = outside_graph_pools(lambda: torch._cslt_compress(self.dense_permuted()), x)
            packed = self._semi["cslt"]
        xg = self._gathered(x)
        xt = xg.reshape(-1, xg.shape[-1]).t()   # [C, T]: cuSPARSELt multiplies the sparse matrix from the left
        key = (str(xt.device), xt.dtype, self.out_features, self.in_features, self.bias is not None, xt.shape[1])
        config = _CSLT_CONFIGS.get(key)
        if config is None:
            config = () if capturing(xt) else _CSLT_CONFIGS.setdefault(key, cslt_search(packed, xt, self.bias))
        y = torch._cslt_sparse_mm(packed, xt, self.bias, None, None, True, *config)
        return y.reshape(*x.shape[:-1], self.out_features)

    def _tma_applies(self, x: torch.Tensor, resident: bool = False) -> bool:
        """Whether ``decode_swap_tma`` (``resident``: ``decode_resident_tma``) can read this layer's weight for
        ``x`` by tensor descriptors (:func:`.nm_decode.tma_applies`; the resident decode's chunks hold at
        least 64 kept values where the layer has them)."""
        from shuffleprune.kernels.nm_decode import tma_applies

        return tma_applies(x, self.values, self.words(), self.n, self.m, self.tiled) and \
            (not resident or self.values.shape[1] >= 64)

    def _candidates(self, x: torch.Tensor) -> list[str]:
        from shuffleprune.kernels.nm_decode import (SELECT_LIMIT_TOKENS, SELECT_MAX_TOKENS, decode_max_tokens, selects,
                                                    triton)
        from shuffleprune.kernels.nm_resident import resident_applies

        if triton is None:
            return ["scratch"]
        tokens = x.numel() // x.shape[-1]
        decode_limit = decode_max_tokens(x.element_size())
        out = []
        if self._pow2():  # from 17 to 64 tokens both Triton kernels are timed
            if tokens <= decode_limit:
                out.append("decode")
            if tokens <= SELECT_MAX_TOKENS:   # the select loop: its pipeline's depth timed both ways
                out.append("decode_shallow")
            # the select loop's other tiles, where the plan takes the select loop: 16-bit inputs (as swept)
            select = selects(tokens, self.n, self.m) and x.element_size() == 2
            out += [impl for impl in ("decode_tall", "decode_wide") if select and tokens <= TILE_MAX_TOKENS[impl]]
            if self.perm is not None and tokens <= min(decode_limit, MAPPED_MAX_TOKENS):
                out.append("decode_mapped")
                out += [impl for impl in ("decode_mapped_tall", "decode_mapped_wide")
                        if select and tokens <= TILE_MAX_TOKENS[impl]]
                if select and (self.n, self.m) == (2, 4) and tokens <= TILE_MAX_TOKENS["decode_mapped_by_value"]:
                    out.append("decode_mapped_by_value")
                if self._offsets_apply():
                    out.append("decode_offsets")
            if select and resident_applies(tokens, self.n, self.m, self.values):   # with a map or without
                out.append("decode_resident")
                if self._tma_applies(x, resident=True):
                    out.append("decode_resident_tma")
            if SELECT_MAX_TOKENS < tokens <= SELECT_LIMIT_TOKENS:   # below, decode is the select kernel already
                out.append("decode_select")
            if 2 <= tokens <= decode_limit:
                out.append("decode_swap")
            if (self.n, self.m) == (2, 4) and x.element_size() == 2:   # as swept and compiled: 2:4, 16-bit inputs
                out += [impl for impl in SWAP_TILES if 2 <= tokens <= TILE_MAX_TOKENS[impl]]
            if 2 <= tokens <= TILE_MAX_TOKENS["decode_swap_tma"] and self._tma_applies(x):
                out.append("decode_swap_tma")
            out += ["gemm", "gemm_swap"] if tokens >= GEMM_MIN_TOKENS else []
            if tokens >= GEMM_MIN_TOKENS and x.element_size() == 2:   # float32 runs the one FMA tile either way
                out.append("gemm_swap_tall")
        if self.tiled and tokens >= GEMM_MIN_TOKENS and x.is_cuda:   # cuSPARSELt on the layer's own buffer
            out.append("cslt")
        out.append("scratch")
        if self._maps_into_scratch() and tokens >= GEMM_MIN_TOKENS:
            out.append("scratch_mapped")
        if tokens <= GATHER_MAX_TOKENS and not self.tiled:
            out.append("gather")
        return [impl for impl in out if impl not in NOT_WEIGHED]

    def _reference(self, x: torch.Tensor) -> torch.Tensor:
        """``x[..., perm] @ W_pᵀ + b`` by PyTorch alone (``W_p`` decompressed into the shared scratch, no
        Triton kernel): what ``auto`` checks each candidate's output against before timing it."""
        buf = scratch_buffer(self.out_features * self.in_features, self.values.device, self.values.dtype)
        w = decompress(self.values, self.export_meta(), self.n, self.m, self.in_features, out=buf)
        return F.linear(self._gathered(x), w, self.bias)

    def _measure(self, x: torch.Tensor, candidates: list[str], calls: int = 10,
                 reps: int = 5) -> tuple[str, str]:
        """The fastest candidate on ``x`` in a CUDA graph and eagerly: each is compiled and run eagerly,
        its output checked against :meth:`_reference` (one that disagrees — a kernel miscompiled or
        racing on this GPU — is dropped with a warning), then at least ``calls`` calls, each on the
        next of :meth:`_weight_copies` (the weight read from DRAM, as in a model, not from L2), are
        captured in one CUDA graph whose replays are timed (median of ``reps``), as a model served
        with CUDA graphs runs them; a candidate that cannot be captured is timed eagerly. The graph's
        winner serves eager calls too unless it is in ``EAGER_CHECKED``: then it and the fastest other
        candidate are timed eagerly and the faster serves them. The shared gather is bypassed, so
        ``decode`` pays for its own gather."""
        fallback = default_choice(candidates)   # what runs if no candidate is timed
        timed: dict[str, float] = {}
        with self._own_gather():
            ref = self._reference(x)
            weights = self._weight_copies()
            for impl in candidates:
                try:
                    if not self._agrees(impl, x, ref):
                        if fallback == impl:
                            fallback = "scratch"
                        continue
                    timed[impl] = self._graph_ms(impl, x, weights, calls, reps)[0]
                except candidate_errors():  # e.g. a tile that does not fit this GPU's shared memory
                    continue
            if overlap_enabled(x) and timed:   # the fastest Triton kernels again, as programmatic dependents
                for impl in pdl_retimed(timed):
                    self._time_pdl(x, ref, impl, timed, weights, calls, reps)
            best = min(timed, key=timed.__getitem__) if timed else fallback   # the first of a tie, as before
            eager = best
            others = sorted((impl for impl in timed if split_pdl(impl)[0] not in EAGER_CHECKED),
                            key=timed.__getitem__)
            if split_pdl(best)[0] in EAGER_CHECKED and others:
                eager = faster_eagerly([best, others[0]], lambda impl: self._run(impl, x), calls, reps)
        return best, eager

    @contextmanager
    def _own_gather(self) -> Iterator[None]:
        """Inside: the layer gathers its input itself, the group's shared gather left as it was."""
        shared, self.shared_gather = self.shared_gather, None
        try:
            yield
        finally:
            self.shared_gather = shared

    def _weight_copies(self) -> list[tuple]:
        """The layer's weight (:meth:`_own_weight`) and copies of it, :func:`timing_copies` in all on a
        CUDA device: the weights :meth:`_graph_ms` cycles through."""
        if self.tiled:
            self._packed_buffer()   # made again first where .to() copied values and meta apart
        weights = [self._own_weight()]
        if not self.values.is_cuda:
            return weights
        from shuffleprune.kernels.gpu import l2_bytes

        count = timing_copies(self.values.nbytes + self.meta.nbytes, l2_bytes(self.values.device),
                              torch.cuda.mem_get_info(self.values.device)[0])
        return weights + [self._weight_copy() for _ in range(count - 1)]

    def _weight_copy(self) -> tuple:
        """A copy of the layer's weight in :meth:`_run_on`'s form (the same layout, new memory)."""
        if self.tiled:
            from shuffleprune.deploy.cslt_layout import split_buffer

            packed = self._packed_buffer().clone()
            return (*split_buffer(packed), packed, None)
        return self.values.clone(), self.meta.clone(), None, None

    def _own_weight(self) -> tuple:
        """The layer's weight in :meth:`_run_on`'s form: ``values``, ``meta``, the cuSPARSELt buffer and
        the position words."""
        return self.values, self.meta, self._packed, self._words

    def _run_on(self, weight: tuple, impl: str, x: torch.Tensor) -> torch.Tensor:
        """:meth:`_run` with the layer's weight swapped for ``weight`` (one of :meth:`_weight_copies`) for
        the call (a CUDA graph captured meanwhile reads that copy at every replay)."""
        own = self._own_weight()
        self.values, self.meta, self._packed, self._words = weight
        try:
            return self._run(impl, x)
        finally:
            self.values, self.meta, self._packed, self._words = own

    def _time_pdl(self, x: torch.Tensor, ref: torch.Tensor, impl: str, timed: dict[str, float],
                  weights: list[tuple], calls: int, reps: int) -> None:
        """Add ``impl`` launched as a programmatic dependent (:data:`PDL_SUFFIX`) to ``timed`` where its
        output agrees and it can be captured in a CUDA graph: that graph's time (:meth:`_graph_ms`), each
        call's kernels starting while the previous call's end, as a model's layers do."""
        pdl = impl + PDL_SUFFIX
        try:
            if self._agrees(pdl, x, ref):
                ms, how = self._graph_ms(pdl, x, weights, calls, reps)
                if how == "cuda_graph":
                    timed[pdl] = ms
        except candidate_errors():
            pass

    def _agrees(self, impl: str, x: torch.Tensor, ref: torch.Tensor) -> bool:
        """Whether ``impl``'s output on ``x`` (compiled and run eagerly) is within :data:`AGREE_RTOL` of
        ``ref``; a warning where it is not (a kernel miscompiled or racing on this GPU)."""
        error = relative_error(self._run(impl, x), ref)
        if error <= AGREE_RTOL:
            return True
        warnings.warn(f"SparseLinear {self.out_features}x{self.in_features}: {impl} is off by {error:.3g} of the "
                      "output's scale on this device; not used", RuntimeWarning, stacklevel=3)
        return False

    def _graph_ms(self, impl: str, x: torch.Tensor, weights: list[tuple], calls: int,
                  reps: int) -> tuple[float, str]:
        """Milliseconds per call of ``impl`` on ``x``: at least ``calls`` calls in one CUDA graph, in turn
        on each of ``weights`` (:meth:`_weight_copies`), median of ``reps`` replays (eagerly timed where
        it cannot be captured), and how (:func:`cuda_graph_ms`)."""
        turns = [weights[i % len(weights)] for i in range(max(calls, len(weights)))]
        return cuda_graph_ms([lambda w=w: self._run_on(w, impl, x) for w in turns], reps, warm=3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():   # one opaque op in the graph; this eager forward runs inside it
            return torch.ops.shuffleprune.sparse_linear(x, self._key)
        return self.eager_forward(x)

    def eager_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The forward outside ``torch.compile``: the layer's stacked group, its policy, or the
        implementation measured fastest for this token count. No tokens (an expert no token was routed
        to, an empty batch): an empty output, nothing launched or measured. An input of another width is
        refused, as ``nn.Linear`` refuses it (the kernels would read its first ``in_features`` columns)."""
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(f"this {self.out_features}×{self.in_features} SparseLinear takes inputs whose last "
                             f"dimension is {self.in_features}, not {tuple(x.shape)}")
        if x.numel() == 0:
            return x.new_empty(*x.shape[:-1], self.out_features)
        if self.fused_inputs is not None:  # one stacked call for the layers reading this input
            y = self.fused_inputs.output(self, x)
            if y is not None:
                return y
        if self.policy != "auto":  # an explicit choice (tests and benchmarks), on any device
            return self._run(self.policy, x)
        if not x.is_cuda:
            return self._run("scratch", x)
        return self._run(self._choice(x), x)

    def _choice(self, x: torch.Tensor) -> str:
        """The implementation of this token-count bucket, inside a CUDA graph capture or outside one:
        measured once per kind of layer. Where the two differ, the one for CUDA graphs is run once
        here, on the calling thread, when the layer takes it (:meth:`_prepare_for_capture`)."""
        bucket = token_bucket(x.numel() // x.shape[-1])
        in_graph = capturing(x)
        if bucket not in self.choices:
            if in_graph:  # nothing can be timed in a capture
                return default_choice(self._candidates(x))
            key = (str(x.device), x.dtype, self.out_features, self.in_features, self.n, self.m,
                   self.map_span, self.bias is not None, self.tiled, bucket)
            if key not in _CHOICES:   # off any CUDA graph pool: the shared scratch it allocates is kept
                _CHOICES[key] = outside_graph_pools(lambda: self._measure(x, self._candidates(x)), x)
            self.choices[bucket], self.eager_choices[bucket] = _CHOICES[key]
            if self.choices[bucket] != self.eager_choices[bucket]:
                self._prepare_for_capture(self.choices[bucket], x)
        return (self.choices if in_graph else self.eager_choices)[bucket]

    def _prepare_for_capture(self, impl: str, x: torch.Tensor) -> None:
        """Run ``impl`` on ``x`` once, now, on the calling thread: what it sets up at its first run must
        exist before a CUDA graph capture, which refuses it. ``auto`` measures on a thread of its own
        (:func:`~shuffleprune.runtime.outside_graph_pools`), and a library's handle is per thread: on an
        H100 (2026-11-27) the prompt of a model whose eager calls ran a Triton GEMM and whose capture ran
        cuSPARSELt could not be captured at all (cuSPARSELt's handle made inside the capture, refused in
        the "global" and "thread_local" capture modes; ``scripts/capture_probe.py``). What the run builds
        and keeps (cuSPARSELt's buffer, a compressed copy) is built off any graph pool, as always."""
        with self._own_gather():
            self._run(impl, x)


_KEYS = itertools.count()
_LAYERS: "weakref.WeakValueDictionary[int, SparseLinear]" = weakref.WeakValueDictionary()


@torch.library.custom_op("shuffleprune::sparse_linear", mutates_args=())
def sparse_linear_op(x: torch.Tensor, key: int) -> torch.Tensor:
    """:class:`SparseLinear` ``key``'s eager forward on ``x`` as one operator, which ``torch.compile``
    keeps whole in its graph: the layer's choices, shared gathers and stacked groups (Python state
    Dynamo would break the graph on) run inside it, and a CUDA graph of the compiled model
    (``mode="reduce-overhead"``) captures the kernels they launch. A stacked group member's rows of
    the group's output are copied out (the compiled graph takes each operator's output as storage of
    its own, which it may reuse once that output is dead: rows of one shared tensor are not)."""
    layer = _LAYERS[key]
    y = layer.eager_forward(x)
    return y.clone(memory_format=torch.contiguous_format) if layer.fused_inputs is not None else y.contiguous()


@sparse_linear_op.register_fake
def _sparse_linear_shape(x: torch.Tensor, key: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], _LAYERS[key].out_features))


AGREE_RTOL = 2e-2   # auto drops a candidate whose largest error exceeds this share of the output's largest magnitude
                    # (16-bit rounding gives at most about 5e-3: scripts/results/bench_kernel.json's max_rel_err)


def pdl_retimed(timed: dict[str, float]) -> list[str]:
    """The candidates of ``timed`` (ms each) that ``auto`` times again as programmatic dependents: the
    :data:`PDL_RETIMED` fastest of :data:`PDL_KERNELS`, and every other one within
    :data:`PDL_RETIME_WITHIN` of the fastest candidate of all, fastest first."""
    fastest = min(timed.values())
    kernels = sorted((impl for impl in timed if impl in PDL_KERNELS), key=timed.__getitem__)
    near = [impl for impl in kernels[PDL_RETIMED:] if timed[impl] <= PDL_RETIME_WITHIN * fastest]
    return kernels[:PDL_RETIMED] + near


def relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest absolute difference over the largest magnitude of ``ref`` (``inf`` for a shape
    mismatch or a non-finite value)."""
    if y.shape != ref.shape:
        return float("inf")
    diff = (y.float() - ref.float()).abs().max()
    return float(diff / ref.float().abs().max().clamp_min(torch.finfo(torch.float32).tiny))


def cslt_search(packed: torch.Tensor, xt: torch.Tensor, bias: torch.Tensor | None) -> tuple[int, ...]:
    """cuSPARSELt's fastest configuration for ``packed @ xt`` (output transposed): ``(alg_id, split_k,
    split_k_mode)`` from ``torch._C._cusparselt.mm_search``, the trailing arguments of
    ``torch._cslt_sparse_mm``. PyTorch builds without it have only the deprecated search, which
    returns the algorithm alone and runs it unsplit (``split_k = 1``)."""
    search = getattr(getattr(torch._C, "_cusparselt", None), "mm_search", None)
    if search is None:
        return (int(torch._cslt_sparse_mm_search(packed, xt, bias, transpose_result=True)),)
    alg_id, split_k, split_k_mode, _ = search(packed, xt, bias, None, None, True)
    return int(alg_id), int(split_k), int(split_k_mode)


def use_cslt_layout(model: nn.Module) -> list[str]:
    """:meth:`SparseLinear.use_cslt_layout` on every sparse layer of ``model`` that is not stacked and can
    take it (in place); returns their names. Run it before ``fuse_shared_inputs``, where the model lives."""
    return [name for name, mod in model.named_modules() if isinstance(mod, SparseLinear) and mod.use_cslt_layout()]


def timing_copies(weight_bytes: int, l2_bytes: int, free_bytes: int) -> int:
    """How many weights of ``weight_bytes`` ``auto``'s timing cycles through (the layer's own and
    copies): together more than :data:`COLD_L2` times the L2, at most 64; only the layer's own where
    it alone is that large or the copies would leave less than 256 MiB of the device's
    ``free_bytes`` (it is then timed partly from L2)."""
    count = min(64, -(-int(COLD_L2 * l2_bytes) // weight_bytes))
    return 1 if count <= 1 or (count - 1) * weight_bytes + 2**28 > free_bytes else count


def faster_eagerly(impls: list[str], run, calls: int, reps: int) -> str:
    """The one of ``impls`` whose ``calls`` calls of ``run(impl)`` take least time run eagerly (the
    host's launches and any per-call setup counted; the first of a tie)."""
    times = {impl: eager_ms([lambda impl=impl: run(impl)] * calls, reps) for impl in impls}
    return min(impls, key=times.__getitem__)


def split_pdl(impl: str) -> tuple[str, bool]:
    """``(implementation, launched as a programmatic dependent)`` of an implementation's name."""
    return impl.removesuffix(PDL_SUFFIX), impl.endswith(PDL_SUFFIX)


def overlap_enabled(x: torch.Tensor) -> bool:
    """Whether the decode kernels may launch as programmatic dependents on ``x``'s device (Hopper on)."""
    from shuffleprune.kernels.overlap import enabled

    return enabled(x)


def default_choice(candidates: list[str]) -> str:
    """What ``auto`` runs where it cannot measure: the decode kernel where it applies, else the
    shared scratch (the fastest on an H100: ``scripts/results/bench_kernel.json``)."""
    return "decode" if "decode" in candidates else "scratch"
