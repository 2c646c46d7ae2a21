"""Sparse layers that read one input tensor run as one layer (q/k/v after the attention norm, gate/up
after the MLP norm): one kernel over their stacked rows instead of one per layer.

At one token a decode kernel's time has a fixed part (launch, pipeline fill, the last wave), so one
12288×4096 call beats three 4096×4096 ones: on an H100 25.3 µs against 3 × 10.6
(``scripts/results/bench_kernel_fused.json``, ``bench_kernel.json``). :func:`fuse_shared_inputs`
finds the groups with forward hooks on a probe (the layers whose input is the *same* tensor, so no
architecture is assumed) among layers of one block with the same width, pattern, dtype, index map
and bias presence. The stacked weight is built on the group's first call, on the device the model
then lives on, and every member's ``values`` / ``meta`` become views of it: GPU memory holds one
copy. The first member called computes the stacked output; the others take their rows of it while
the input is the same tensor, unmodified (as :class:`SharedGather` does for inputs); once every
member has taken its rows, the group lets go of both tensors.
"""
from __future__ import annotations

from functools import partial
from typing import Callable

import torch
from torch import nn

from shuffleprune.block_inputs import block_probe
from shuffleprune.blocks import find_blocks
from shuffleprune.deploy.block_io import record_block_io
from shuffleprune.deploy.shared_input import InputShared
from shuffleprune.deploy.sparse_linear import SparseLinear
from shuffleprune.runtime.graph_pools import capturing, outside_graph_pools


class FusedInputs:
    """A group of :class:`SparseLinear` layers reading one input: runs them as one layer."""

    def __init__(self, layers: list[SparseLinear]):
        self.layers = layers
        self.offsets: dict[int, tuple[int, int]] = {}
        start = 0
        for layer in layers:
            self.offsets[id(layer)] = (start, start + layer.out_features)
            start += layer.out_features
        self.stacked: SparseLinear | None = None  # built on the first call, where the layers live
        self._views: list[torch.Tensor] = []      # the members' values as _build made them (views of its rows)
        self.output_cache = InputShared(len(layers))   # the stacked output, until every member took its rows

    def _current(self) -> bool:
        """Whether the members still hold the views of the stacked rows :meth:`_build` gave them (a
        ``.to()``, a dtype change or an assignment replaces a member's buffers) and the first member
        the stacked layer's map. Checked at every member's call, so by identity: comparing devices,
        dtypes and storages through ``nn.Module`` attribute lookups made a member's call (its kernel
        stubbed) 19.8 µs of host time on a 2-core CPU, against 5.6 so (``scripts/bench_host_overhead.py``)."""
        s = self.stacked
        if s is None or self.layers[0]._buffers.get("perm") is not s._buffers.get("perm"):
            return False
        for layer, view in zip(self.layers, self._views):
            if layer._buffers.get("values") is not view:
                return False
        return True

    def _build(self) -> None:
        """Stack the members' rows into one layer and make each member's buffers views of it."""
        first = self.layers[0]
        values = torch.cat([layer.values for layer in self.layers])
        meta = torch.cat([layer.export_meta() for layer in self.layers])
        bias = None if first.bias is None else torch.cat([layer.bias.data for layer in self.layers])
        self.stacked = SparseLinear(values, meta, first.in_features, first.n, first.m, first.perm, bias,
                                    policy=first.policy)
        if first.tiled:   # one cuSPARSELt buffer for the group (its 64-row bands are the members' bands in turn)
            del values, meta
            self.stacked.use_cslt_layout()
            values, meta = self.stacked.values, self.stacked.meta
        for layer in self.layers:
            lo, hi = self.offsets[id(layer)]
            layer.values, layer.meta = values[lo:hi], meta[lo:hi]
            layer._packed = None   # a member's own buffer, if it had one, is freed (a view of the stack's rows serves)
            if bias is not None:
                layer.bias = nn.Parameter(bias[lo:hi], requires_grad=False)
        self._views = [layer._buffers["values"] for layer in self.layers]
        self.output_cache.release()

    def output(self, layer: SparseLinear, x: torch.Tensor) -> torch.Tensor | None:
        """``layer``'s output on ``x`` from the group's stacked call (``None`` where the group cannot
        run: its first call falling inside a CUDA graph capture, where nothing may be allocated)."""
        current = self._current()
        if not current:
            if capturing(x):
                return None
            outside_graph_pools(self._build, x)   # forgets the cached output; kept, so outside a compiled model's pool
        lo, hi = self.offsets[id(layer)]
        return self.output_cache.get(x, id(layer), self.stacked)[..., lo:hi]


def _compatible(a: SparseLinear, b: SparseLinear) -> bool:
    same_map = (a.perm is None and b.perm is None) or (
        a.perm is not None and b.perm is not None and torch.equal(a.perm, b.perm))
    return (a.tiled == b.tiled and a.in_features == b.in_features and (a.n, a.m) == (b.n, b.m)
            and a.values.dtype == b.values.dtype and a.values.device == b.values.device and a.meta.shape[1] == b.meta.shape[1]
            and (a.bias is None) == (b.bias is None) and a.policy == b.policy and same_map)


def _unfused(module: nn.Module) -> bool:
    return isinstance(module, SparseLinear) and getattr(module, "fused_inputs", None) is None


def fuse_shared_inputs(model: nn.Module, probe: Callable[[int], torch.Tensor] | None = None) -> list[list[str]]:
    """Group ``model``'s sparse layers that read one input tensor, block by block (in place); returns
    the groups' layer names. ``probe``: a :func:`~shuffleprune.block_inputs.block_probe` of ``model`` to
    reuse (built here if None; never for a model without sparse layers)."""
    blocks = find_blocks(model)
    if not any(isinstance(mod, SparseLinear) for mod in model.modules()):
        return []
    run = probe or block_probe(model, blocks)
    made = []
    for i, block in enumerate(blocks.layers):
        io = record_block_io(block, partial(run, i), _unfused, outputs=False)
        for names in io.readers_by_input():
            layers = [block.get_submodule(n) for n in names]
            group = [layers[0]] + [layer for layer in layers[1:] if _compatible(layers[0], layer)]
            if len(group) < 2:
                continue
            fused = FusedInputs(group)
            for layer in group:
                layer.fused_inputs = fused
            made.append([f"{blocks.prefix(i)}.{n}" for n, layer in zip(names, layers) if layer in group])
    return made


def unfuse_shared_inputs(model: nn.Module) -> int:
    """Undo :func:`fuse_shared_inputs`: every stacked layer's members run on their own again (on views of
    the stacked rows, so memory stays one copy); returns how many layers were members."""
    members = [mod for mod in model.modules() if isinstance(mod, SparseLinear) and mod.fused_inputs is not None]
    for layer in members:
        layer.fused_inputs = None
    return len(members)
