"""Checks for Triton kernels run by the interpreter (``TRITON_INTERPRET=1``): out-of-bounds accesses, programs
run out of order, programs storing to the same address (:func:`install`), and reads of memory nobody wrote
(:func:`poisoned_empties`).

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
And two programs of one launch storing to the same address (not by atomics) race on a GPU, whichever
wins: each launch's plain stores are checked to come from one program per address.
"""
from __future__ import annotations

import functools
import threading
from contextlib import contextmanager

import numpy as np


class OutOfBounds(AssertionError):
    """A kernel touched memory outside every tensor it was given."""


class Race(AssertionError):
    """Two programs of one launch stored to the same address without atomics."""


class _Launch:
    """What the checks know of the running launch: its kernel's name, its tensors' spans, the program
    running, and the plain stores so far (flat addresses, program)."""

    def __init__(self, kernel: str, raw: list[tuple[int, int]]):
        self.kernel, self.raw, self.spans = kernel, raw, sorted_spans(raw)
        self.program, self.atomic = 0, False
        self.stores: list[tuple[np.ndarray, int]] = []


_state = threading.local()    # .now: the running _Launch (None outside a launch)
violations: list[str] = []    # every refusal, also those a caller's ``except`` swallowed (the tests' fixture reads it)


def interpreter_mismatch(triton_version: str, numpy_version: str) -> str | None:
    """Why the installed Triton's interpreter cannot run these tests, or None: before Triton 3.7 it reads a
    one-element block as an index with ``int(array)``, which numpy 2.4 refuses for arrays of one dimension
    (every kernel test would fail with "only 0-dimensional arrays can be converted to Python scalars")."""
    from packaging.version import Version   # transformers' dependency

    if Version(triton_version).release[:2] < (3, 7) and Version(numpy_version).release[:2] >= (2, 4):
        return (f"Triton {triton_version}'s interpreter cannot run with numpy {numpy_version} (it reads a block as an "
                "index through int(array), which numpy 2.4 refuses): pip install 'numpy<2.4' or 'triton>=3.7'")
    return None


def installed_interpreter_mismatch() -> str | None:
    """:func:`interpreter_mismatch` of the installed Triton and numpy (None without Triton)."""
    try:
        import triton
    except ImportError:
        return None
    return interpreter_mismatch(triton.__version__, np.__version__)


def _refuse(error: type[AssertionError], message: str) -> None:
    violations.append(message)
    raise error(message)


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


def shared_stores(stores: list[tuple[np.ndarray, int]]) -> tuple[int, int, int] | None:
    """An address two programs stored to, and the two, among ``stores`` (flat addresses, program); None."""
    stores = [(a, p) for a, p in stores if a.size]
    if len({p for _, p in stores}) < 2:
        return None
    addresses = np.concatenate([a for a, _ in stores])
    programs = np.concatenate([np.full(a.size, p, dtype=np.int64) for a, p in stores])
    order = np.argsort(addresses, kind="stable")
    addresses, programs = addresses[order], programs[order]
    clash = np.flatnonzero((addresses[1:] == addresses[:-1]) & (programs[1:] != programs[:-1]))
    if clash.size == 0:
        return None
    i = int(clash[0])
    return int(addresses[i]), int(programs[i]), int(programs[i + 1])


def shuffled_programs(nx: int, ny: int, nz: int) -> list[tuple[int, int, int]]:
    """Every program id of an ``nx × ny × nz`` grid once, in an order shuffled by a generator seeded with the
    grid's shape."""
    ids = [(x, y, z) for x in range(nx) for y in range(ny) for z in range(nz)]
    order = np.random.default_rng([nx, ny, nz]).permutation(len(ids))
    return [ids[i] for i in order]


def _checked(ptrs, mask) -> np.ndarray | None:
    """The addresses ``mask`` lets through, each checked to lie within the launch's tensors (None outside a
    launch: a builder call of none, which Triton's interpreter does not make)."""
    now = getattr(_state, "now", None)
    if now is None:
        return None
    addresses = np.asarray(ptrs.data, dtype=np.uint64)
    if mask is not None:
        addresses = addresses[np.broadcast_to(np.asarray(mask.data, dtype=bool), addresses.shape)]
    addresses = addresses.reshape(-1)
    if addresses.size == 0:
        return addresses
    item = max(1, ptrs.get_element_ty().primitive_bitwidth // 8)
    stray = stray_addresses(addresses, item, now.spans)
    if stray.size:
        near = ", ".join(f"[{s:#x}, {e:#x})" for s, e in now.raw)
        _refuse(OutOfBounds, f"{now.kernel}: {stray.size} of {addresses.size} addresses outside its tensors, "
                             f"first {int(stray[0]):#x} ({item}-byte elements); the tensors span {near}")
    return addresses


def install() -> bool:
    """Patch Triton's interpreter so every launch checks its memory accesses and stores and runs its programs
    shuffled (idempotent). False where the interpreter lacks the hooks this relies on (another Triton):
    nothing changes."""
    try:
        from triton.runtime import interpreter as interp
    except ImportError:
        return False
    builder, executor = getattr(interp, "InterpreterBuilder", None), getattr(interp, "GridExecutor", None)
    hooks = ("create_masked_load", "create_masked_store", "create_atomic_rmw", "create_atomic_cas",
             "create_atomic_store", "set_grid_dim", "set_grid_idx")
    if builder is None or executor is None or not all(hasattr(builder, h) for h in hooks) \
            or not hasattr(executor, "_init_args_hst"):
        return False
    if getattr(builder, "_checked", False):
        return True
    load, store, rmw, cas, atomic_store, grid_dim_set, grid_idx_set = (getattr(builder, h) for h in hooks)
    init_args, call = executor._init_args_hst, executor.__call__

    def masked_load(self, ptrs, mask, other, cache_policy, is_volatile):
        _checked(ptrs, mask)
        return load(self, ptrs, mask, other, cache_policy, is_volatile)

    def masked_store(self, ptrs, value, mask, cache_policy):
        addresses = _checked(ptrs, mask)
        now = _state.now
        if addresses is not None and not now.atomic:
            now.stores.append((addresses, now.program))
        return store(self, ptrs, value, mask, cache_policy)

    def atomic_store_(self, ptr, val, mask, sem, scope):   # through masked_store, not a plain store
        now = getattr(_state, "now", None)
        if now is not None:
            now.atomic = True
        try:
            return atomic_store(self, ptr, val, mask, sem, scope)
        finally:
            if now is not None:
                now.atomic = False

    def atomic_rmw(self, rmw_op, ptr, val, mask, sem, scope):
        _checked(ptr, mask)
        return rmw(self, rmw_op, ptr, val, mask, sem, scope)

    def atomic_cas(self, ptr, cmp, val, sem, scope):
        _checked(ptr, None)
        return cas(self, ptr, cmp, val, sem, scope)

    def init_args_hst(self, args_dev, kwargs):
        args_hst, kwargs_hst = init_args(self, args_dev, kwargs)
        _state.now = _Launch(getattr(self.fn, "__name__", "a kernel"),
                             sorted(tensor_spans([*args_hst, *kwargs_hst.values()])))
        return args_hst, kwargs_hst

    def launch(self, *args, **kwargs):
        outer = getattr(_state, "now", None)
        try:
            result = call(self, *args, **kwargs)
            now = _state.now
            clash = shared_stores(now.stores) if now is not None else None
            if clash:
                address, first, second = clash
                _refuse(Race, f"{now.kernel}: programs {first} and {second} of one launch both store to {address:#x} "
                              "(without atomics: on a GPU whichever runs last wins)")
            return result
        finally:
            _state.now = outer

    def grid_dim(self, nx, ny, nz):
        grid_dim_set(self, nx, ny, nz)
        self._program_order = shuffled_programs(nx, ny, nz)

    def grid_idx(self, x, y, z):   # the loop's k-th program runs as the k-th of the shuffled order
        nx, ny, nz = self.grid_dim
        program = self._program_order[(x * ny + y) * nz + z]
        now = getattr(_state, "now", None)
        if now is not None:
            now.program = (program[0] * ny + program[1]) * nz + program[2]
        return grid_idx_set(self, *program)

    builder.set_grid_dim, builder.set_grid_idx = grid_dim, grid_idx
    builder.create_masked_load, builder.create_masked_store = masked_load, masked_store
    builder.create_atomic_rmw, builder.create_atomic_cas, builder.create_atomic_store = atomic_rmw, atomic_cas, atomic_store_
    executor._init_args_hst, executor.__call__ = init_args_hst, launch
    builder._checked = True
    return True


_EMPTIES = ("empty", "empty_like", "empty_strided")


def poison(t):
    """Fill a tensor fresh from an ``empty`` as PyTorch's ``fill_uninitialized_memory`` does: NaN where it
    holds floats, the largest value where it holds integers (what a GPU's uninitialized memory may hold)."""
    import torch

    if t.numel() and not t.is_meta:
        if t.is_floating_point() or t.is_complex():
            t.fill_(float("nan"))
        elif t.dtype != torch.bool:
            t.fill_(torch.iinfo(t.dtype).max)
    return t


@contextmanager
def poisoned_empties():
    """``torch.empty``, ``empty_like``, ``empty_strided`` and ``Tensor.new_empty`` give poisoned tensors
    (:func:`poison`) while this lasts: a kernel that reads a scratch element no program wrote (a partial sum
    of a split with no work, say) then computes NaN or an absurd index here, where fresh memory on the CPU
    (or a GPU's, often zeroed) would have hidden it."""
    import torch

    originals = {name: getattr(torch, name) for name in _EMPTIES}
    new_empty = torch.Tensor.new_empty

    def wrap(make):
        return functools.wraps(make)(lambda *args, **kwargs: poison(make(*args, **kwargs)))

    try:
        for name, make in originals.items():
            setattr(torch, name, wrap(make))
        torch.Tensor.new_empty = wrap(new_empty)
        yield
    finally:
        for name, make in originals.items():
            setattr(torch, name, make)
        torch.Tensor.new_empty = new_empty
