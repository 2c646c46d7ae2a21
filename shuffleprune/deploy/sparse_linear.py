"""``SparseLinear``: the deployed form of a pruned (and possibly permuted) linear layer.

``y = W_p · x[perm] + b`` with ``W_p`` held compressed only (``values`` + packed positions, see
:mod:`format`) and ``perm`` the input index map (``None`` when the layer reads its input in order).
No layer keeps a dense copy: GPU memory holds the compressed size.

The layer holds its weight and index map, knows which implementations can run it for an input
(:meth:`SparseLinear.candidates`, by the rules of :mod:`.impl_rules`; the implementations and their kernel
options are :mod:`.impls`) and
runs one (:meth:`SparseLinear.run`): its ``policy``, or under ``policy="auto"`` the one
:mod:`.auto_choice` measured fastest for this kind of layer and token count (on the CPU ``scratch``).
Under ``torch.compile`` the layer is one opaque operator (:func:`sparse_linear_op`).
"""
from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from shuffleprune.deploy import auto_choice, impl_rules
from shuffleprune.deploy.format import decompress, meta_bits
from shuffleprune.deploy.impls import (CSLT_TOKEN_MULTIPLE, DECODE_KERNELS, GEMM_KERNELS, IMPLS, MAPPED_DECODES,
                                       PDL_SUFFIX, SPARSE_GEMM, SPARSE_MMA_DECODES, SPARSE_WGMMA, SPARSE_WGMMA_MAPPED,
                                       default_choice, known_policy, split_pdl)
from shuffleprune.deploy.input_gather import gather_input, map_span, token_bucket
from shuffleprune.deploy.shared_input import SharedGather
from shuffleprune.runtime.graph_pools import capturing, outside_graph_pools

_SCRATCH: dict[tuple[str, torch.dtype], torch.Tensor] = {}


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


class SparseLinear(nn.Module):
    """A compressed N:M linear layer with an optional input index map."""

    def __init__(self, values: torch.Tensor, meta: torch.Tensor, in_features: int, n: int, m: int,
                 perm: torch.Tensor | None = None, bias: torch.Tensor | None = None, policy: str = "auto"):
        super().__init__()
        if not known_policy(policy):
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

    def inverse_map(self) -> torch.Tensor:
        """The index map's inverse as int32 (``inverse[perm[j]] = j``), made once per map (again after
        ``.to()`` replaced it)."""
        if self._inverse is None or self._inverse[0] is not self.perm:
            perm = self.perm
            self._inverse = (perm, outside_graph_pools(lambda: torch.argsort(perm).to(torch.int32), perm))
        return self._inverse[1]

    def block_map(self) -> tuple[torch.Tensor, int] | None:
        """The map as 1-byte offsets within its blocks and their span (``decode_offsets``), made once per
        map, outside any CUDA graph capture (inside one with none made yet, and for a map that jumps
        further: None, and the int32 map is read)."""
        if not impl_rules.offsets_apply(self):
            return None
        if self._offsets is None or self._offsets[0] is not self.perm:
            if capturing(self.perm):
                return None
            from shuffleprune.kernels.nm_decode import block_map_offsets

            perm, span = self.perm, self.map_span
            self._offsets = (perm, (outside_graph_pools(lambda: block_map_offsets(perm, span), perm), span))
        return self._offsets[1]

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
        if self.values.is_cuda and impl_rules.pow2(self):
            from shuffleprune.kernels.nm_gemm import nm_decompress_into

            return nm_decompress_into(self.values, self.words(), self.n, self.m, self.bits, self.in_features, buf,
                                      tiled=self.tiled)
        return decompress(self.values, self.export_meta(), self.n, self.m, self.in_features, out=buf)

    def run(self, impl: str, x: torch.Tensor) -> torch.Tensor:
        """``x[..., perm] @ W_pᵀ + b`` by implementation ``impl`` (one of ``IMPLS``, perhaps ``+pdl``;
        one that does not apply to this input runs its nearest that does: :func:`.impl_rules.runs_as`)."""
        impl, pdl = split_pdl(impl)
        impl = impl_rules.runs_as(self, impl, x)
        if impl in ("decode_resident", "decode_resident_tma"):   # reads the map itself, once per program
            from shuffleprune.kernels.nm_resident import nm_decode_resident

            return nm_decode_resident(x, self.values, self.words(), self.n, self.m, self.bits, self.perm, self.bias,
                                      tiled=self.tiled, pdl=pdl, tma=impl == "decode_resident_tma")
        if impl in SPARSE_MMA_DECODES:
            from shuffleprune.kernels.nm_sparse_mma import nm_sparse_mma

            mapped = impl_rules.sparse_mma_maps(self, impl)
            inp, perm = (x, self.perm) if mapped else (self._gathered(x, pdl), None)
            inline = {"inline_map": True} if mapped and impl.endswith("_inline") else {}
            return nm_sparse_mma(inp, self.values, self.words(), self.bias, tiled=self.tiled, perm=perm, pdl=pdl,
                                 tall=impl.endswith("_tall"), **inline)
        if impl == SPARSE_WGMMA_MAPPED:
            from shuffleprune.kernels.nm_sparse_gemm import nm_sparse_gemm

            return nm_sparse_gemm(x, self.values, self.words(), self.bias, tiled=self.tiled, wgmma=True, perm=self.perm)
        if impl in (SPARSE_GEMM, SPARSE_WGMMA):
            from shuffleprune.kernels.nm_sparse_gemm import nm_sparse_gemm

            return nm_sparse_gemm(self._gathered(x, pdl), self.values, self.words(), self.bias, tiled=self.tiled,
                                  wgmma=impl == SPARSE_WGMMA)
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
        this kind of layer and token count (:func:`.auto_choice.cslt_config`): on the layer's own buffer
        after :meth:`use_cslt_layout`, else on a compressed copy made at the first call. The tokens are
        padded with zeros to a multiple of :data:`CSLT_TOKEN_MULTIPLE`, as PyTorch's own 2:4 tensors pad
        the dense operand for cuSPARSELt, so every token count of a bucket runs what ``auto`` chose."""
        if self.tiled:
            packed = self._packed_buffer()
        else:
            if "cslt" not in self._semi:
                self._semi["cslt"] = outside_graph_pools(lambda: torch._cslt_compress(self.dense_permuted()), x)
            packed = self._semi["cslt"]
        xg = self._gathered(x)
        x2 = xg.reshape(-1, xg.shape[-1])
        tokens = x2.shape[0]
        pad = -tokens % CSLT_TOKEN_MULTIPLE
        if pad:   # zero tokens up to cuSPARSELt's multiple, their rows of the output dropped
            x2 = F.pad(x2, (0, 0, 0, pad))
        xt = x2.t()   # [C, T]: cuSPARSELt multiplies the sparse matrix from the left
        config = auto_choice.cslt_config(packed, xt, self.bias, self.out_features)
        y = torch._cslt_sparse_mm(packed, xt, self.bias, None, None, True, *config)
        return (y[:tokens] if pad else y).reshape(*x.shape[:-1], self.out_features)

    def candidates(self, x: torch.Tensor) -> list[str]:
        """The implementations ``auto`` weighs for this layer on ``x`` (its token count, dtype and device),
        in the order it times them (:func:`.impl_rules.candidates`)."""
        return impl_rules.candidates(self, x)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """``x[..., perm] @ W_pᵀ + b`` by PyTorch alone (``W_p`` decompressed into the shared scratch, no
        Triton kernel): what ``auto`` checks each candidate's output against before timing it."""
        buf = scratch_buffer(self.out_features * self.in_features, self.values.device, self.values.dtype)
        w = decompress(self.values, self.export_meta(), self.n, self.m, self.in_features, out=buf)
        return F.linear(self._gathered(x), w, self.bias)

    @contextmanager
    def own_gather(self) -> Iterator[None]:
        """Inside: the layer gathers its input itself, the group's shared gather left as it was."""
        shared, self.shared_gather = self.shared_gather, None
        try:
            yield
        finally:
            self.shared_gather = shared

    def weight_copies(self, count: int) -> list[tuple]:
        """The layer's weight (:meth:`_own_weight`) and ``count - 1`` copies of it, each in :meth:`run_on`'s
        form: what ``auto``'s timing cycles through (:func:`.auto_choice.weight_copies`)."""
        if self.tiled:
            self._packed_buffer()   # made again first where .to() copied values and meta apart
        return [self._own_weight()] + [self._weight_copy() for _ in range(count - 1)]

    def _weight_copy(self) -> tuple:
        """A copy of the layer's weight in :meth:`run_on`'s form (the same layout, new memory)."""
        if self.tiled:
            from shuffleprune.deploy.cslt_layout import split_buffer

            packed = self._packed_buffer().clone()
            return (*split_buffer(packed), packed, None)
        return self.values.clone(), self.meta.clone(), None, None

    def _own_weight(self) -> tuple:
        """The layer's weight in :meth:`run_on`'s form: ``values``, ``meta``, the cuSPARSELt buffer and
        the position words."""
        return self.values, self.meta, self._packed, self._words

    def run_on(self, weight: tuple, impl: str, x: torch.Tensor) -> torch.Tensor:
        """:meth:`run` with the layer's weight swapped for ``weight`` (one of :meth:`weight_copies`) for
        the call (a CUDA graph captured meanwhile reads that copy at every replay)."""
        own = self._own_weight()
        self.values, self.meta, self._packed, self._words = weight
        try:
            return self.run(impl, x)
        finally:
            self.values, self.meta, self._packed, self._words = own

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
            return self.run(self.policy, x)
        if not x.is_cuda:
            return self.run("scratch", x)
        return self.run(self._choice(x), x)

    def _choice(self, x: torch.Tensor) -> str:
        """The implementation of this token-count bucket, inside a CUDA graph capture or outside one:
        measured once per kind of layer. Where the two differ, the one for CUDA graphs is run once
        here, on the calling thread, when the layer takes it (:meth:`_prepare_for_capture`)."""
        bucket = token_bucket(x.numel() // x.shape[-1])
        in_graph = capturing(x)
        if bucket not in self.choices:
            if in_graph:  # nothing can be timed in a capture
                return default_choice(self.candidates(x))
            self.choices[bucket], self.eager_choices[bucket] = auto_choice.measured_choice(self, x, bucket)
            if self.choices[bucket] != self.eager_choices[bucket]:
                self._prepare_for_capture(self.choices[bucket], x)
        return (self.choices if in_graph else self.eager_choices)[bucket]

    def _prepare_for_capture(self, impl: str, x: torch.Tensor) -> None:
        """Run ``impl`` on ``x`` once, now, on the calling thread: what it sets up at its first run must
        exist before a CUDA graph capture, which refuses it. ``auto`` measures on a thread of its own
        (:func:`~shuffleprune.runtime.graph_pools.outside_graph_pools`), and a library's handle is per thread: on an
        H100 (2026-11-27) the prompt of a model whose eager calls ran a Triton GEMM and whose capture ran
        cuSPARSELt could not be captured at all (cuSPARSELt's handle made inside the capture, refused in
        the "global" and "thread_local" capture modes; ``scripts/capture_probe.py``). What the run builds
        and keeps (cuSPARSELt's buffer, a compressed copy) is built off any graph pool, as always."""
        with self.own_gather():
            self.run(impl, x)


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


def use_cslt_layout(model: nn.Module) -> list[str]:
    """:meth:`SparseLinear.use_cslt_layout` on every sparse layer of ``model`` that is not stacked and can
    take it (in place); returns their names. Run it before ``fuse_shared_inputs``, where the model lives."""
    return [name for name, mod in model.named_modules() if isinstance(mod, SparseLinear) and mod.use_cslt_layout()]
