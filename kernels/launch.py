"""Triton launches without Triton's per-call dispatch: each kernel's compiled form reused by key.

Every ``kernel[grid](…)`` of a ``@triton.jit`` function first pays Triton's dispatch on the host —
binding the arguments to the signature, specializing each (dtype and 16-byte alignment of a pointer,
an integer equal to 1 or divisible by 16), building the cache key and looking it up — and only then
the driver's launch. Public measurements put that dispatch at 9–13 µs per call for ~19 arguments on
recent hosts against 3–5 µs for calling the compiled kernel's launcher directly; the decode kernel
has 36 parameters, and an eager decode step (a plain ``generate()`` without CUDA graphs) launches
about eight of our kernels per decoder layer. :func:`fast` wraps a kernel so that ``fast(k)[grid](…)``
keys each call by a refinement of what Triton specializes on (:func:`arg_key`: never one key where
Triton would compile two kernels) and, for a key seen before, calls the compiled kernel's launcher
with what Triton's dispatch passes it — grid, stream, function, packed metadata, the hooks as Triton
holds them, then every argument in signature order, constants included — except the launch metadata,
which only a hook reads (None: what Triton's dispatch passes where an unset hook is None; 3.9 builds it
anyway, its unset hooks being empty chains). The first call of each
key goes through Triton, compiling where needed, and keeps the compiled kernel it returns. What a
call's keyword arguments fix (whether it can go fast, the constants in signature order) is worked out
once per kind of call (:class:`BoundLaunch`); a caller that launches one kind again and again
(``nm_decode``) holds its ``fast(k).bind(…)`` and passes only the grid and positional arguments.
``scripts/check_fast_launch.py`` compares the two launches argument by argument (compile-only on the
CPU, a test runs it) and their outputs on a GPU.

Triton's own dispatch runs instead under the interpreter (``TRITON_INTERPRET=1``), inside
:func:`enabled` ``(False)`` (the compile-only check), with a launch hook set (a profiler reading launch
metadata), for a grid given as a function, an argument passed by name that is not a compile-time
constant, or ``SHUFFLEPRUNE_FAST_LAUNCH=0`` in the environment.
"""
from __future__ import annotations

import contextlib
import inspect
import os
from collections.abc import Iterator
from typing import Any

import torch

try:
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction
except ImportError:  # pragma: no cover - triton is a Linux dependency
    JITFunction = driver = None
try:
    from triton import knobs
except ImportError:  # a Triton before knobs (3.4): launch hooks cannot be read, so never fast
    knobs = None
try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # a Triton before host-side tensor descriptors (3.4): none is passed
    TensorDescriptor = None

_STATE = {"enabled": os.environ.get("SHUFFLEPRUNE_FAST_LAUNCH", "1") != "0"}
_I32 = (-(1 << 31), 1 << 31)


def _tensor_key(t: torch.Tensor) -> tuple:
    return t.dtype, not t.data_ptr() & 15


def _int_key(v: int) -> tuple:
    return int, v == 1, not v & 15, _I32[0] <= v < _I32[1], v < (1 << 63)


def _descriptor_key(d: Any) -> tuple:
    return "tensordesc", d.base.dtype, tuple(d.block_shape), d.padding, getattr(d, "round_f32_to_tf32", False)


_KEYS = {torch.Tensor: _tensor_key, torch.nn.Parameter: _tensor_key, int: _int_key,
         bool: lambda v: (bool, v), float: lambda v: float, type(None): lambda v: None,
         **({TensorDescriptor: _descriptor_key} if TensorDescriptor is not None else {})}


def arg_key(value: Any) -> Any:
    """What a runtime (not ``constexpr``) argument contributes to a launch's key: for a tensor its dtype
    and whether its address is 16-byte aligned; for an integer whether it is 1, divisible by 16, and
    whether it fits 32 bits or 64 (Triton's ``i32``/``i64``/``u64``); a bool its value; a float
    nothing but its kind; None itself; a host tensor descriptor its tensor's dtype and its block shape
    (Triton's ``tensordesc<i32[64, 64]>``; Triton 3.6 and 3.9 specialize on nothing else of it) and
    its padding. The compiled kernel's launcher turns a descriptor into the TMA's own at each launch,
    on either path. Anything else raises ``TypeError`` (the call goes through Triton's dispatch)."""
    key = _KEYS.get(type(value))
    if key is not None:
        return key(value)
    if isinstance(value, torch.Tensor):   # a subclass
        return _tensor_key(value)
    raise TypeError(f"no launch key for a {type(value).__name__}")


_TENSOR, _PARAMETER = torch.Tensor, torch.nn.Parameter
_U64 = 1 << 63


def args_key(args: tuple) -> tuple:
    """``tuple(map(arg_key, args))`` in one pass, tensors and integers without a call each (the key of
    every fast launch: a decode launch has 16 positional arguments)."""
    lo, hi = _I32
    return tuple([(a.dtype, not a.data_ptr() & 15) if (kind := type(a)) is _TENSOR or kind is _PARAMETER else
                  (int, a == 1, not a & 15, lo <= a < hi, a < _U64) if kind is int else arg_key(a) for a in args])


class FastKernel:
    """A ``@triton.jit`` kernel launched through its compiled kernel once a key has been seen."""

    def __init__(self, kernel: Any):
        self.kernel = kernel
        self.jit = JITFunction is not None and isinstance(kernel, JITFunction)
        params = list(inspect.signature(kernel.fn).parameters.values()) if self.jit else []
        self.names = [p.name for p in params]
        self.defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
        self.constexpr = {kp.name for kp in kernel.params if kp.is_constexpr} if self.jit else set()
        self._bound: dict[tuple, BoundLaunch] = {}    # (positional count, keyword items) → that kind of call
        self.fast_launches = 0                        # launches that skipped Triton's dispatch (for the checks)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def _plan(self, n_args: int, names: tuple[str, ...]) -> tuple | None:
        """For a call of ``n_args`` positional arguments and keywords ``names``: the names of the
        parameters after the positional ones (each from the keywords or its default), or None where the
        call cannot go fast (a positional constant, a runtime argument by name, a parameter missing)."""
        if any(name in self.constexpr for name in self.names[:n_args]):
            return None
        rest = self.names[n_args:]
        if any(name not in self.constexpr and name in names for name in rest):
            return None
        if any(name not in names and name not in self.defaults for name in rest):
            return None
        return tuple(rest)

    def bind(self, n_args: int, kwargs: dict) -> "BoundLaunch":
        """The launches of this kernel with ``n_args`` positional arguments and these keyword arguments
        (one :class:`BoundLaunch` per kind, kept): a caller that launches the same kind of call again and
        again holds it and calls it with the grid and the positional arguments alone."""
        try:
            kind = (n_args, tuple(kwargs.items()))
            bound = self._bound.get(kind)
        except TypeError:   # an unhashable constant: never fast
            return BoundLaunch(self, n_args, kwargs, hashable=False)
        if bound is None:
            bound = self._bound[kind] = BoundLaunch(self, n_args, kwargs)
        return bound

    def launch(self, grid, args: tuple, kwargs: dict) -> Any:
        """``kernel[grid](*args, **kwargs)``, through the compiled kernel where this kind of call was seen."""
        return self.bind(len(args), kwargs)(grid, *args)


class BoundLaunch:
    """One kind of call of a :class:`FastKernel` (its count of positional arguments and its keyword
    arguments): what they fix — whether it can go fast, the constants after the positional arguments in
    signature order — is worked out once, and each call keys only its positional arguments
    (:func:`args_key`) and the device."""

    def __init__(self, kernel: FastKernel, n_args: int, kwargs: dict, hashable: bool = True):
        self.fast_kernel, self.n_args, self.kwargs = kernel, n_args, kwargs
        plan = kernel._plan(n_args, tuple(kwargs)) if kernel.jit and hashable else None
        self.tail = None if plan is None else tuple(kwargs[name] if name in kwargs else kernel.defaults[name]
                                                    for name in plan)
        self._compiled: dict[tuple, Any] = {}   # (device, argument keys) → the compiled kernel

    def __call__(self, grid, *args) -> Any:
        """``kernel[grid](*args, **kwargs)``: the compiled kernel's launcher for arguments keyed as before,
        else Triton's dispatch (which compiles where needed; its compiled kernel is kept)."""
        fk = self.fast_kernel
        if self.tail is None or not _STATE["enabled"] or callable(grid) or len(args) != self.n_args \
                or getattr(fk.kernel, "pre_run_hooks", None) or _hooked():
            return fk.kernel[grid](*args, **self.kwargs)
        device = driver.active.get_current_device()
        try:
            key = (device, args_key(args))
        except TypeError:   # an argument of another kind
            return fk.kernel[grid](*args, **self.kwargs)
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = fk.kernel[grid](*args, **self.kwargs)
            if all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata")):
                self._compiled[key] = compiled
            return compiled
        g = grid if len(grid) == 3 else (*grid, 1, 1)
        compiled.run(g[0], g[1], g[2], driver.active.get_current_stream(device), compiled.function,
                     compiled.packed_metadata, None, knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook,
                     *args, *self.tail)
        fk.fast_launches += 1
        return compiled


def _hooked() -> bool:
    """Whether a launch hook is set (a profiler): Triton's dispatch then builds the launch metadata the
    hook reads. An unset hook is None, or an empty chain of hooks (Triton 3.9)."""
    if knobs is None:
        return True
    runtime = knobs.runtime
    for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return True
    return False


_FAST: dict[int, FastKernel] = {}


def fast(kernel: Any) -> FastKernel:
    """The :class:`FastKernel` of ``kernel`` (one per kernel, made at its first use)."""
    wrapped = _FAST.get(id(kernel))
    if wrapped is None or wrapped.kernel is not kernel:
        wrapped = _FAST[id(kernel)] = FastKernel(kernel)
    return wrapped


@contextlib.contextmanager
def enabled(on: bool = True) -> Iterator[None]:
    """Fast launches on (or off) inside, whatever the environment says (the checks and benchmarks; off
    in the compile-only check, which replaces Triton's dispatch)."""
    before = _STATE["enabled"]
    _STATE["enabled"] = on
    try:
        yield
    finally:
        _STATE["enabled"] = before
