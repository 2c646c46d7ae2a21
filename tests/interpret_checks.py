"""Checks for Triton kernels run by the interpreter (``TRITON_INTERPRET=1``): out-of-bounds accesses, and
programs run out of order.

On a GPU a load or store outside every tensor a kernel was given is an illegal address that ends the
process (or, inside another allocation, silently wrong data); the interpreter reads and writes host
memory as it is, so such a kernel passes its CPU tests. With :func:`install` every interpreted load,
store and atomic checks that each address its mask lets through lies, whole, within one of the
launch's tensor arguments (the span its sizes and strides reach from its first element, not the whole
storage: a read past a view's end is refused too) and raises :class:`OutOfBounds` naming the kernel
and the first stray address otherwise. Tensor-descriptor (TMA) copies are checked too: the interpreter
reads them as masked loads of the descriptor's shape (clipped there, as the hardware clips), so a
descriptor declared larger than its tensor is caught.

The interpreter also runs a launch's programs one after another in grid order, where a GPU runs them
side by side in any order: a kernel that relies on program 0 running first (say, to zero a buffer the
others then add to) passes there and fails on a GPU. With :func:`install` each launch runs its programs
in a shuffled order instead (seeded by the grid's shape, so a failure repeats), each still exactly once.
"""
from __future__ import annotations

import threading

import numpy as np


class OutOfBounds(AssertionError):
    """A kernel touched memory outside every tensor it was given."""


_launch = threading.local()   # .spans: the running launch's tensor spans (sorted_spans); .kernel: its name
violations: list[str] = []    # every refusal, also those a caller's ``except`` swallowed (the tests' fixture reads it)


def tensor_spans(args) -> list[tuple[int, int]]:
    """``(first byte, one past the last byte)`` of each tensor in ``args`` (nested in tuples, or a tensor
    descriptor's base), as far as its sizes and strides reach; empty tensors have none."""
    import torch

    spans = []
    for arg in args:
        if isinstance(arg, (tuple, list)):
            spans += tensor_spans(arg)
            continue
        base = getattr(arg, "base", None)
        if isinstance(base, torch.Tensor) and not isinstance(arg, torch.Tensor):   # TensorWrapper, TensorDescriptor
            arg = base
        if not isinstance(arg, torch.Tensor) or arg.numel() == 0:
            continue
        reach = sum((size - 1) * abs(stride) for size, stride in zip(arg.shape, arg.stride()))
        spans.append((arg.data_ptr(), arg.data_ptr() + (reach + 1) * arg.element_size()))
    return spans


def sorted_spans(spans: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """``spans`` as their starts, ascending, and for each the furthest end of it and those before it (so an
    address is inside some span exactly when it ends before the furthest end of those starting at or below it)."""
    order = sorted(spans)
    return (np.array([s for s, _ in order], dtype=np.uint64),
            np.maximum.accumulate(np.array([e for _, e in order], dtype=np.uint64)))


def stray_addresses(addresses: np.ndarray, item_bytes: int, spans: list[tuple[int, int]] | tuple) -> np.ndarray:
    """Those of ``addresses`` (byte addresses of ``item_bytes``-byte elements) not lying whole in a span
    (``spans``: pairs, or :func:`sorted_spans` of them)."""
    if len(spans) == 0 or (isinstance(spans, tuple) and spans[0].size == 0):
        return addresses
    starts, ends = spans if isinstance(spans, tuple) else sorted_spans(spans)
    low, high = addresses.min(), addresses.max()   # the usual case: one tile of one tensor, checked at its ends
    at = int(np.searchsorted(starts, low, side="right")) - 1
    if at >= 0 and high + np.uint64(item_bytes) <= ends[at]:   # one span reaches from below low past high
        return addresses[:0]
    at = np.searchsorted(starts, addresses, side="right").astype(np.int64) - 1
    covered = (at >= 0) & (addresses + np.uint64(item_bytes) <= ends[np.maximum(at, 0)])
    return addresses[~covered]


def shuffled_programs(nx: int, ny: int, nz: int) -> list[tuple[int, int, int]]:
    """Every program id of an ``nx × ny × nz`` grid once, in an order shuffled by a generator seeded with the
    grid's shape."""
    ids = [(x, y, z) for x in range(nx) for y in range(ny) for z in range(nz)]
    order = np.random.default_rng([nx, ny, nz]).permutation(len(ids))
    return [ids[i] for i in order]


def _check(ptrs, mask) -> None:
    spans = getattr(_launch, "spans", None)
    if spans is None:   # a builder call outside a launch (none in Triton's interpreter): nothing to check against
        return
    addresses = np.asarray(ptrs.data, dtype=np.uint64)
    if mask is not None:
        addresses = addresses[np.broadcast_to(np.asarray(mask.data, dtype=bool), addresses.shape)]
    addresses = addresses.reshape(-1)
    if addresses.size == 0:
        return
    item = max(1, ptrs.get_element_ty().primitive_bitwidth // 8)
    stray = stray_addresses(addresses, item, spans)
    if stray.size:
        near = ", ".join(f"[{s:#x}, {e:#x})" for s, e in _launch.raw)
        violations.append(f"{_launch.kernel}: {stray.size} of {addresses.size} addresses outside its tensors, "
                          f"first {int(stray[0]):#x} ({item}-byte elements); the tensors span {near}")
        raise OutOfBounds(violations[-1])


def install() -> bool:
    """Patch Triton's interpreter so every launch checks its memory accesses and runs its programs shuffled
    (idempotent). False where the interpreter lacks the hooks this relies on (another Triton): nothing changes."""
    try:
        from triton.runtime import interpreter as interp
    except ImportError:
        return False
    builder, executor = getattr(interp, "InterpreterBuilder", None), getattr(interp, "GridExecutor", None)
    hooks = ("create_masked_load", "create_masked_store", "create_atomic_rmw", "create_atomic_cas", "set_grid_dim",
             "set_grid_idx")
    if builder is None or executor is None or not all(hasattr(builder, h) for h in hooks) \
            or not hasattr(executor, "_init_args_hst"):
        return False
    if getattr(builder, "_bounds_checked", False):
        return True
    load, store, rmw, cas = (getattr(builder, h) for h in hooks[:4])
    init_args, call = executor._init_args_hst, executor.__call__

    def masked_load(self, ptrs, mask, other, cache_policy, is_volatile):
        _check(ptrs, mask)
        return load(self, ptrs, mask, other, cache_policy, is_volatile)

    def masked_store(self, ptrs, value, mask, cache_policy):
        _check(ptrs, mask)
        return store(self, ptrs, value, mask, cache_policy)

    def atomic_rmw(self, rmw_op, ptr, val, mask, sem, scope):
        _check(ptr, mask)
        return rmw(self, rmw_op, ptr, val, mask, sem, scope)

    def atomic_cas(self, ptr, cmp, val, sem, scope):
        _check(ptr, None)
        return cas(self, ptr, cmp, val, sem, scope)

    def init_args_hst(self, args_dev, kwargs):
        args_hst, kwargs_hst = init_args(self, args_dev, kwargs)
        _launch.raw = sorted(tensor_spans([*args_hst, *kwargs_hst.values()]))
        _launch.spans = sorted_spans(_launch.raw)
        _launch.kernel = getattr(self.fn, "__name__", "a kernel")
        return args_hst, kwargs_hst

    def launch(self, *args, **kwargs):
        outer = getattr(_launch, "spans", None), getattr(_launch, "raw", None), getattr(_launch, "kernel", None)
        try:
            return call(self, *args, **kwargs)
        finally:
            _launch.spans, _launch.raw, _launch.kernel = outer

    def grid_dim(self, nx, ny, nz):
        grid_dim_set(self, nx, ny, nz)
        self._program_order = shuffled_programs(nx, ny, nz)

    def grid_idx(self, x, y, z):   # the loop's k-th program runs as the k-th of the shuffled order
        nx, ny, nz = self.grid_dim
        return grid_idx_set(self, *self._program_order[(x * ny + y) * nz + z])

    grid_dim_set, grid_idx_set = builder.set_grid_dim, builder.set_grid_idx
    builder.set_grid_dim, builder.set_grid_idx = grid_dim, grid_idx
    builder.create_masked_load, builder.create_masked_store = masked_load, masked_store
    builder.create_atomic_rmw, builder.create_atomic_cas = atomic_rmw, atomic_cas
    executor._init_args_hst, executor.__call__ = init_args_hst, launch
    builder._bounds_checked = True
    return True
